"""KV-cache events in vLLM's schema (`vllm/distributed/kv_events.py`), so vLLM's consumers (llm-d's KV indexer,
Dynamo's KV router) read ours unchanged: an EventBatch is a msgpack array [ts, events, data_parallel_rank]; each
event is a msgpack map tagged by its class name ("type": "BlockStored"), default-valued optional fields omitted.
"""
from __future__ import annotations

from typing import Any

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
