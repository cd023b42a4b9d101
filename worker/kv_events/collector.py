"""`KVEventCollector`: the sink the BlockPool reports its prefix-cache changes to. Pure bookkeeping: the engine
thread drains it after each step (`take`) and the publisher (publisher.py) sends the batch."""
from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Callable

from disagg.worker.kv_events.schema import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, KVCacheEvent


class KVEventCollector:
    """Collects the BlockPool's cache changes between two `take()`s. Consecutive stores of one chain (a request's
    newly full blocks) merge into one BlockStored, as vLLM's engine emits them."""

    def __init__(self, block_size: int, medium: str = "GPU", clock: Callable[[], float] = time.time):
        self.block_size = block_size
        self.medium = medium
        self._clock = clock
        self._events: list[KVCacheEvent] = []

    def stored(self, block_hash: bytes, parent_hash: bytes | None, token_ids: Sequence[int]) -> None:
        last = self._events[-1] if self._events else None
        if isinstance(last, BlockStored) and last.block_hashes[-1] == parent_hash and parent_hash is not None:
            last.block_hashes.append(block_hash)
            last.token_ids.extend(int(t) for t in token_ids)
            return
        self._events.append(BlockStored(block_hashes=[block_hash], parent_block_hash=parent_hash,
                                        token_ids=[int(t) for t in token_ids], block_size=self.block_size,
                                        lora_id=None, medium=self.medium, lora_name=None))

    def removed(self, block_hash: bytes) -> None:
        last = self._events[-1] if self._events else None
        if isinstance(last, BlockRemoved):
            last.block_hashes.append(block_hash)
            return
        self._events.append(BlockRemoved(block_hashes=[block_hash], medium=self.medium))

    def cleared(self) -> None:
        self._events = [AllBlocksCleared()]  # what came before it no longer matters

    def take(self) -> EventBatch | None:
        """The events since the last take, as one batch; None when there were none."""
        if not self._events:
            return None
        events, self._events = self._events, []
        return EventBatch(ts=self._clock(), events=events)
