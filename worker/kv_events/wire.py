"""The KV-event wire protocol (vLLM's): how the live and replay messages are framed, and what a batch's sequence
number says about the ones before it.

Live, PUB -> SUB: (topic, seq, payload); seq is an 8-byte big-endian signed integer counting batches from 0 per
publishing process, payload a msgpack EventBatch (schema.py). Replay, DEALER -> ROUTER: (b"", start seq); the
answer is (b"", topic, seq, payload) for each buffered batch from start on, then (b"", b"", END_OF_REPLAY, b"").
A subscriber sees a restarted publisher as the sequence going back, and lost batches as a gap.
"""
from __future__ import annotations

import enum

SEQ_BYTES = 8
END_OF_REPLAY = -1  # the sequence number of the message that closes a replay answer

Frames = tuple[bytes, ...]


def seq_frame(seq: int) -> bytes:
    return seq.to_bytes(SEQ_BYTES, "big", signed=True)


def live_frames(topic: bytes, seq: int, payload: bytes) -> Frames:
    return topic, seq_frame(seq), payload


def parse_live(frames: list[bytes]) -> tuple[int, bytes] | None:
    """(seq, payload) of a live message; None when it is malformed."""
    if len(frames) != 3 or len(frames[1]) != SEQ_BYTES:
        return None
    return int.from_bytes(frames[1], "big", signed=True), frames[2]


def replay_request(start: int) -> Frames:
    """What a DEALER sends to ask for the buffered batches from `start` on."""
    return b"", seq_frame(start)


def parse_replay_request(frames: list[bytes]) -> tuple[bytes, int] | None:
    """(the asking peer's identity, the start seq) as the ROUTER socket receives a request; None when malformed.
    The start is read unsigned, as vLLM's publisher reads it."""
    if len(frames) != 3 or len(frames[2]) != SEQ_BYTES:
        return None
    return frames[0], int.from_bytes(frames[2], "big")


def replay_frames(peer: bytes, topic: bytes, seq: int, payload: bytes) -> Frames:
    """One buffered batch of a replay answer, as the ROUTER socket sends it to `peer`."""
    return peer, b"", topic, seq_frame(seq), payload


def end_of_replay_frames(peer: bytes) -> Frames:
    return peer, b"", b"", seq_frame(END_OF_REPLAY), b""


def parse_replay_answer(frames: list[bytes]) -> tuple[int, bytes] | None:
    """(seq, payload) of one replay answer as the DEALER receives it (seq END_OF_REPLAY: the answer is complete);
    None when malformed."""
    if len(frames) != 4 or len(frames[2]) != SEQ_BYTES:
        return None
    return int.from_bytes(frames[2], "big", signed=True), frames[3]


class Applied(enum.Enum):
    IN_ORDER = "in_order"  # the next sequence number: applied on top
    RESET = "reset"  # the sequence went back (a restarted publisher): cleared, then applied
    GAP = "gap"  # sequence numbers were skipped: cleared, then applied
    DUPLICATE = "duplicate"  # already applied (a replayed batch seen live too): ignored


def sequence_outcome(seq: int, last_seq: int | None, replayed: bool) -> tuple[Applied, int]:
    """How batch `seq` follows the last one applied (None: none yet), and how many batches were lost before it.
    replayed: the batch came from the replay socket, where a sequence at or below the last one is a duplicate
    rather than a restart."""
    expected = 0 if last_seq is None else last_seq + 1
    if seq < expected:
        return (Applied.DUPLICATE if replayed else Applied.RESET), 0
    if seq > expected:  # a first batch past 0 is a late join (the replay buffer had wrapped): not a loss
        return Applied.GAP, seq - expected if last_seq is not None else 0
    return Applied.IN_ORDER, 0
