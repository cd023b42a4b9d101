"""The router's view of each worker's prefix cache, built from its KV-cache events (pure; no I/O).

Per endpoint: the set of block hashes it announced (BlockStored minus BlockRemoved) and the last sequence number
applied. A sequence that goes back (the worker restarted) or an AllBlocksCleared empties the endpoint's set; a gap
(events lost and not replayed) empties it too, since what was lost may have removed blocks - a stale entry would
predict a hit that is not there (that costs only a recompute, but a cleared entry costs nothing).
"""
from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, field

from disagg.worker.engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent


class Applied(enum.Enum):
    IN_ORDER = "in_order"  # the next sequence number: applied on top
    RESET = "reset"  # the sequence went back (a restarted worker): cleared, then applied
    GAP = "gap"  # sequence numbers were skipped: cleared, then applied
    DUPLICATE = "duplicate"  # already applied (a replayed batch seen live too): ignored


@dataclass
class EndpointBlocks:
    blocks: set[bytes | int] = field(default_factory=set)  # block hashes the worker holds
    last_seq: int | None = None  # None: nothing applied yet
    block_size: int | None = None  # from its BlockStored events


@dataclass
class KVIndex:
    endpoints: dict[str, EndpointBlocks] = field(default_factory=dict)  # url -> its blocks

    def apply(self, url: str, seq: int, events: Iterable[KVCacheEvent], replayed: bool = False) -> tuple[Applied, int]:
        """Apply one batch of `url`'s events; returns how, and how many batches were lost before it.
        replayed: the batch came from the replay socket, where a sequence at or below the last one is a
        duplicate rather than a restart."""
        entry = self.endpoints.setdefault(url, EndpointBlocks())
        outcome, lost = Applied.IN_ORDER, 0
        expected = 0 if entry.last_seq is None else entry.last_seq + 1
        if seq < expected and replayed:
            return Applied.DUPLICATE, 0
        if seq < expected:
            outcome = Applied.RESET
            entry.blocks.clear()
        elif seq > expected:  # a first batch past 0 is a late join (the replay buffer had wrapped): not a loss
            outcome, lost = Applied.GAP, seq - expected if entry.last_seq is not None else 0
            entry.blocks.clear()
        entry.last_seq = seq
        for event in events:
            _apply_event(entry, event)
        return outcome, lost

    def drop(self, url: str) -> None:
        """The endpoint is gone (or unready): forget it; a new subscription starts over."""
        self.endpoints.pop(url, None)

    def last_seq(self, url: str) -> int | None:
        entry = self.endpoints.get(url)
        return entry.last_seq if entry else None

    def prefix_blocks(self, url: str, block_hashes: list[bytes]) -> int:
        """How many leading blocks of a prompt (its chain hashes) the endpoint holds."""
        entry = self.endpoints.get(url)
        if entry is None:
            return 0
        n = 0
        for h in block_hashes:
            if h not in entry.blocks:
                break
            n += 1
        return n

    def block_size(self, url: str) -> int | None:
        entry = self.endpoints.get(url)
        return entry.block_size if entry else None


def _apply_event(entry: EndpointBlocks, event: KVCacheEvent) -> None:
    if isinstance(event, BlockStored):
        entry.blocks.update(event.block_hashes)
        entry.block_size = event.block_size
    elif isinstance(event, BlockRemoved):
        entry.blocks.difference_update(event.block_hashes)
    elif isinstance(event, AllBlocksCleared):
        entry.blocks.clear()
