"""KV-cache events in vLLM's schema (`vllm/distributed/kv_events.py`), so vLLM's consumers (llm-d's KV indexer,
Dynamo's KV router) read ours unchanged: an EventBatch is a msgpack array [ts, events, data_parallel_rank]; each
event is a msgpack map tagged by its class name ("type": "BlockStored"), default-valued optional fields omitted.

`KVEventCollector` is the sink the BlockPool reports to: pure bookkeeping, the engine thread drains it after
each step and a publisher (worker/server/kv_events_publisher.py) sends the batch.
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Callable

import msgspec


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float  # wall-clock seconds when the batch was taken
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the events; tag=True: each encodes its class name under "type"."""


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]  # consecutive full blocks, each chained on the one before
    parent_block_hash: bytes | int | None  # the block before the first one; None: they start the prompt
    token_ids: list[int]  # len(block_hashes) * block_size tokens
    block_size: int
    lora_id: int | None  # vLLM's fields without defaults are always written (None here: no LoRA)
    medium: str | None  # "GPU" | "CPU": where the blocks live
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def encode_batch(batch: EventBatch) -> bytes:
    return msgspec.msgpack.encode(batch)


def decode_batch(payload: bytes) -> KVEventBatch:
    """Raises msgspec.DecodeError (a ValueError) on a payload that is not a KV event batch."""
    return msgspec.msgpack.decode(payload, type=KVEventBatch)


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
