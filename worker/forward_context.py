"""Per-step attention metadata handed to attention layers without threading it through forward().

The model runner sets it around each forward pass; layers read it with get_forward_context().
A ContextVar (not a module global) keeps concurrent engines in one process apart.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from disagg.worker.kv_transfer.base import KVConnectorBase


@dataclass
class AttentionMetadata:
    """The step's batch is the concatenation of each request's new tokens, requests in order.

    Requests with one new token (decode) come first, then the rest (prefill chunks)."""

    num_decodes: int  # the first num_decodes requests have exactly one new token
    query_start_loc: list[int]  # (B+1,) cumulative new-token counts; request i is rows [q[i], q[i+1])
    seq_lens: list[int]  # (B,) tokens in context after this step (cached + new)
    seq_lens_tensor: torch.Tensor  # (B,) int64, same values, on the model's device
    block_tables: torch.Tensor  # (B, max_blocks) int64 block ids, padded with 0
    slot_mapping: torch.Tensor  # (T,) int64 flat slot = block_id * block_size + offset, per new token
    block_size: int


@dataclass
class ForwardContext:
    attn_metadata: AttentionMetadata | None  # None for a dummy / profiling run (no KV cache writes)
    kv_cache: torch.Tensor | None  # (num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim)
    kv_connector: "KVConnectorBase | None" = None  # worker-side connector; layers call its hooks
    extra: dict[str, Any] | None = None


_FORWARD_CONTEXT: ContextVar[ForwardContext | None] = ContextVar("disagg_forward_context", default=None)


def get_forward_context() -> ForwardContext:
    ctx = _FORWARD_CONTEXT.get()
    if ctx is None:
        raise RuntimeError("no forward context: the model must run inside set_forward_context()")
    return ctx


@contextlib.contextmanager
def set_forward_context(ctx: ForwardContext) -> Iterator[ForwardContext]:
    token = _FORWARD_CONTEXT.set(ctx)
    try:
        yield ctx
    finally:
        _FORWARD_CONTEXT.reset(token)
