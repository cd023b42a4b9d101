"""The worker's KV-cache event publisher: a ZMQ PUB socket sends each batch, a ROUTER socket answers replay
requests from a buffer of the last batches (framing: wire.py). Sequence numbers start at 0 per process.

One thread owns both sockets (ZMQ sockets are not thread-safe); `publish` only enqueues.
"""
from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from dataclasses import dataclass

import zmq

from disagg.worker.kv_events import wire
from disagg.worker.kv_events.schema import EventBatch, encode_batch

logger = logging.getLogger(__name__)

_POLL_MS = 100


@dataclass
class KVEventsInfo:
    """What a subscriber needs (served at the worker's GET /kv_events)."""

    endpoint: str  # the bound PUB address, e.g. tcp://0.0.0.0:5557 (a wildcard host means every interface)
    replay_endpoint: str | None  # the bound ROUTER address
    topic: str
    block_size: int  # tokens per block hash


def replay_endpoint_for(endpoint: str) -> str:
    """The replay socket's default address: the PUB port + 1 (an ephemeral port stays ephemeral)."""
    head, sep, port = endpoint.rpartition(":")
    if not sep or not head.startswith("tcp://"):
        raise ValueError(f"--kv-events-endpoint {endpoint!r}: expected tcp://HOST:PORT")
    if port in ("*", "0"):
        return f"{head}:*"
    try:
        return f"{head}:{int(port) + 1}"
    except ValueError:
        raise ValueError(f"--kv-events-endpoint {endpoint!r}: the port {port!r} is not a number") from None


WILDCARD_HOSTS = ("*", "0.0.0.0", "::", "[::]")


def bind_endpoint(endpoint: str, worker_host: str) -> str:
    """The address to bind for `--kv-events-endpoint`: without a host (tcp://:5557) the worker's own --host when
    that names one address, else loopback - never every interface unless asked for by name (tcp://*:5557)."""
    if endpoint.startswith("tcp://:"):
        host = "127.0.0.1" if worker_host in WILDCARD_HOSTS or not worker_host else worker_host
        return f"tcp://{host}{endpoint[len('tcp://'):]}"
    return endpoint


def binds_every_interface(endpoint: str) -> bool:
    host = endpoint.removeprefix("tcp://").rpartition(":")[0]
    return host in WILDCARD_HOSTS


def _bind_address(endpoint: str) -> str:
    # zmq spells "any port" tcp://host:*; accept :0 as well (as the rest of the CLI does)
    return endpoint[:-2] + ":*" if endpoint.endswith(":0") else endpoint


class ZmqEventPublisher:
    def __init__(self, endpoint: str, replay_endpoint: str | None, block_size: int, topic: str = "",
                 buffer_steps: int = 10_000, hwm: int = 100_000, data_parallel_rank: int = 0):
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._replay: zmq.Socket | None = None
        try:
            self._pub.set_hwm(hwm)
            self._pub.bind(_bind_address(endpoint))
            if replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.bind(_bind_address(replay_endpoint))
        except zmq.ZMQError as e:
            self._close_sockets()
            raise ValueError(f"cannot bind the KV events socket ({endpoint}, replay {replay_endpoint}): {e}") \
                from None
        self.info = KVEventsInfo(
            endpoint=self._pub.getsockopt_string(zmq.LAST_ENDPOINT),
            replay_endpoint=self._replay.getsockopt_string(zmq.LAST_ENDPOINT) if self._replay else None,
            topic=topic, block_size=block_size)
        self._topic = topic.encode()
        self._rank = data_parallel_rank
        self._queue: queue.SimpleQueue[EventBatch | None] = queue.SimpleQueue()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)  # (seq, payload) for replay
        self._next_seq = 0
        self.published = 0  # batches sent (read by tests and logs)
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()
        logger.info("publishing KV events on %s (replay %s)", self.info.endpoint, self.info.replay_endpoint)

    def publish(self, batch: EventBatch) -> None:
        """Thread-safe; the batch is sent in order by the publisher thread."""
        if batch.data_parallel_rank is None:
            batch.data_parallel_rank = self._rank
        self._queue.put(batch)

    def close(self, timeout: float = 2.0) -> None:
        """Send what is queued, then close the sockets."""
        self._queue.put(None)
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning("KV events thread did not stop within %.1fs", timeout)
            return
        self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._ctx.term()

    def _run(self) -> None:
        while True:
            if self._replay is not None and self._replay.poll(0):
                # A replay answers with every batch published before the request came, including those still
                # queued: a subscriber that joined after they were queued would not see them live.
                if not self._send_queued():
                    self._answer_replay()
                    return
                self._answer_replay()
            try:
                batch = self._queue.get(timeout=_POLL_MS / 1000)
            except queue.Empty:
                continue
            if batch is None:
                return
            self._send_logged(batch)

    def _send_queued(self) -> bool:
        """Send what is queued now; False when the close marker was among it."""
        while True:
            try:
                batch = self._queue.get_nowait()
            except queue.Empty:
                return True
            if batch is None:
                return False
            self._send_logged(batch)

    def _send_logged(self, batch: EventBatch) -> None:
        try:
            self._send(batch)
        except zmq.ZMQError:  # a full or closing socket: counted as a gap by the subscriber
            logger.exception("sending a KV event batch failed")

    def _send(self, batch: EventBatch) -> None:
        seq, payload = self._next_seq, encode_batch(batch)
        self._next_seq += 1
        self._buffer.append((seq, payload))
        self._pub.send_multipart(wire.live_frames(self._topic, seq, payload))
        self.published += 1

    def _answer_replay(self) -> None:
        frames = self._replay.recv_multipart()
        request = wire.parse_replay_request(frames)
        if request is None:
            logger.warning("ignoring a malformed KV events replay request (%d frames)", len(frames))
            return
        peer, start_seq = request
        for seq, payload in self._buffer:
            if seq >= start_seq:
                self._replay.send_multipart(wire.replay_frames(peer, self._topic, seq, payload))
        self._replay.send_multipart(wire.end_of_replay_frames(peer))
