"""Attention over the paged KV cache, shared by every model family.

A family's attention layer projects q, k, v (and applies its position encoding), then calls
PagedAttention, which: finds the step's metadata and KV cache in the forward context, calls the
KV connector's per-layer hooks, writes the new tokens' K and V at their slots, and attends -
decodes in one batched op over their block tables, prefill chunks in one call of our CPU kernel
(cpu_kernels.prefill_attention; off CPU or where it does not apply, SDPA one sequence at a time).
Without metadata (a dummy run) it is plain causal attention over the given k, v.

KV cache: (num_blocks, num_layers, 2, block_size, n_kv_heads, head_dim), contiguous (see
kv_transfer/base.py); the batch is flat: T tokens of several requests (see AttentionMetadata).
"""
from __future__ import annotations

import math
from functools import cached_property

import torch
import torch.nn.functional as F
from torch import nn

from disagg.worker.model import cpu_kernels
from disagg.worker.forward_context import AttentionMetadata, ForwardContext, get_forward_context


class PagedIndex:
    """Index tensors of one step, shared by every attention layer (built once, cached in ctx.extra).

    kv_rows: (layers, 2, T) row of each new token's K and V in the cache viewed as (rows, n_kv * hd).
    decode_blocks, decode_mask: what the torch decode path needs, made when first asked for - the CPU
    kernel reads the block tables in place, and building a mask as wide as the longest context cost
    every step several small tensor ops it never used."""

    def __init__(self, kv_rows: torch.Tensor, md: AttentionMetadata, dtype: torch.dtype):
        self.kv_rows = kv_rows
        self._md, self._dtype = md, dtype
        B = md.num_decodes
        self._n_blocks = -(-max(md.seq_lens[:B], default=0) // md.block_size)  # the longest decode's

    @cached_property
    def decode_blocks(self) -> torch.Tensor:
        """(B_dec * n_blocks,) block ids of the decodes, padded to the longest."""
        return self._md.block_tables[:self._md.num_decodes, :self._n_blocks].reshape(-1)

    @cached_property
    def decode_mask(self) -> torch.Tensor:
        """(B_dec, 1, 1, n_blocks * block_size) additive: 0 in context, -inf past it (as SDPA would make from
        the bool one, made once per step instead of in every layer)."""
        md = self._md
        key_pos = torch.arange(self._n_blocks * md.block_size, device=md.block_tables.device)  # (S,)
        in_context = key_pos[None, :] < md.seq_lens_tensor[:md.num_decodes, None]  # (B, S)
        mask = torch.zeros(in_context.shape, dtype=self._dtype, device=key_pos.device)
        return mask.masked_fill_(~in_context, -math.inf)[:, None, None, :]

    @staticmethod
    def build(md: AttentionMetadata, kv_cache: torch.Tensor) -> PagedIndex:
        if not kv_cache.is_contiguous():  # rows are addressed in a flat view of it
            raise ValueError(f"the KV cache must be contiguous; got strides {kv_cache.stride()}")
        num_layers, bs = kv_cache.shape[1], md.block_size
        dev = md.slot_mapping.device
        block_ids = torch.div(md.slot_mapping, bs, rounding_mode="floor")  # (T,)
        # cache (num_blocks, layers, 2, block_size, ...): row = ((block * layers + layer) * 2 + kv) * bs + offset
        slot_rows = block_ids * (num_layers * 2 * bs) + md.slot_mapping % bs  # (T,) layer 0, K
        layer_kv = torch.arange(num_layers * 2, device=dev).view(num_layers, 2, 1) * bs  # (layers, 2, 1)
        return PagedIndex(slot_rows + layer_kv, md, kv_cache.dtype)


def paged_index(ctx: ForwardContext) -> PagedIndex:
    """The step's PagedIndex, built by the first layer that asks when ctx.extra can hold it."""
    if ctx.extra is None:
        return PagedIndex.build(ctx.attn_metadata, ctx.kv_cache)
    index = ctx.extra.get("paged_index")
    if index is None:
        index = ctx.extra["paged_index"] = PagedIndex.build(ctx.attn_metadata, ctx.kv_cache)
    return index


class PagedAttention(nn.Module):
    """Scaled dot-product attention of one layer over the paged KV cache (no parameters)."""

    def __init__(self, layer_idx: int, layer_name: str, n_heads: int, n_kv_heads: int, head_dim: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.layer_name = layer_name  # what the KV connector's per-layer hooks are called with
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.scale = head_dim**-0.5

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: (T, n_heads, head_dim); k, v: (T, n_kv_heads, head_dim) -> (T, n_heads, head_dim)."""
        ctx = get_forward_context()
        if ctx.attn_metadata is None:
            return self._attend(q, k, v, causal_offset=0)  # dummy run: one causal sequence, no cache
        md = ctx.attn_metadata
        kv_cache = ctx.kv_cache
        if kv_cache is None:
            raise ValueError(f"{self.layer_name}: attn_metadata is set but kv_cache is None")
        if ctx.kv_connector is not None:
            ctx.kv_connector.wait_for_layer_load(self.layer_name)
        index = paged_index(ctx)
        self._write_kv(kv_cache, index, k, v)
        if ctx.kv_connector is not None:
            ctx.kv_connector.save_kv_layer(self.layer_name, kv_cache, md)

        layer_cache = kv_cache[:, self.layer_idx]  # (num_blocks, 2, block_size, n_kv_heads, head_dim) view
        n_dec = md.num_decodes
        if n_dec == len(md.seq_lens):
            return self._decode_attention(index, layer_cache, q, kv_cache, md)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # (T, n_heads, head_dim), contiguous
        if n_dec:
            out[:n_dec] = self._decode_attention(index, layer_cache, q[:n_dec], kv_cache, md)
        done: set[int] = set()
        if n_dec < len(md.seq_lens) and cpu_kernels.supports_prefill(q, k, v):
            # our kernel, each kind of chunk in one call: those with nothing cached before them read their
            # own K/V where they lie, those that continue a cached prefix read it all from the cache's blocks
            chunks = range(n_dec, len(md.seq_lens))
            fresh = [i for i in chunks if md.seq_lens[i] == md.query_start_loc[i + 1] - md.query_start_loc[i]]
            cont = [i for i in chunks if md.seq_lens[i] != md.query_start_loc[i + 1] - md.query_start_loc[i]]
            cpu_kernels.prefill_attention(q, k, v, [md.query_start_loc[i] for i in fresh],
                                          [md.seq_lens[i] for i in fresh], self.scale, out)
            done = set(fresh)
            if cont and kv_cache.dtype == torch.float32:
                q_lens = [md.query_start_loc[i + 1] - md.query_start_loc[i] for i in cont]
                cpu_kernels.paged_prefill_attention(
                    q, kv_cache, self.layer_idx, md.block_tables[cont], [md.query_start_loc[i] for i in cont],
                    q_lens, [md.seq_lens[i] - n for i, n in zip(cont, q_lens)], self.scale, out)
                done.update(cont)
        for i in range(n_dec, len(md.seq_lens)):
            if i in done:
                continue
            start, end = md.query_start_loc[i], md.query_start_loc[i + 1]
            seq_len, q_len = md.seq_lens[i], end - start
            if seq_len == q_len:  # nothing cached before this chunk: use the fresh K/V directly
                k_ctx, v_ctx = k[start:end], v[start:end]
            else:
                k_ctx, v_ctx = _gather(layer_cache, md.block_tables[i : i + 1], md.block_size, seq_len)
                k_ctx, v_ctx = k_ctx[0, :seq_len].to(q.dtype), v_ctx[0, :seq_len].to(q.dtype)
            out[start:end] = self._attend(q[start:end], k_ctx, v_ctx, causal_offset=seq_len - q_len)
        return out

    def _write_kv(self, kv_cache: torch.Tensor, index: PagedIndex, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the new tokens' K and V (T, n_kv_heads, head_dim) at their slots of this layer."""
        T = k.shape[0]
        k_rows, v_rows = index.kv_rows[self.layer_idx]  # (T,) each
        if cpu_kernels.can_write(k, kv_cache):  # a memcpy per row, reading k and v where they lie
            cpu_kernels.write_kv_rows(kv_cache, k_rows, v_rows, k, v)
            return
        rows = kv_cache.view(-1, k.shape[1] * k.shape[2])  # (num_blocks * layers * 2 * block_size, n_kv * hd)
        # index_copy_ of whole rows: much cheaper than advanced-index assignment into the 6-d cache
        rows.index_copy_(0, k_rows, k.reshape(T, -1).to(kv_cache.dtype))
        rows.index_copy_(0, v_rows, v.reshape(T, -1).to(kv_cache.dtype))

    def _decode_attention(self, index: PagedIndex, layer_cache: torch.Tensor, q: torch.Tensor,
                          kv_cache: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        """All single-token requests in one batched op. q: (B, n_heads, head_dim)."""
        B, group = q.shape[0], self.n_heads // self.n_kv_heads
        if cpu_kernels.supports(q, kv_cache, self.n_kv_heads):  # in place over the blocks, no K/V copies
            return cpu_kernels.paged_decode_attention(q, kv_cache, self.layer_idx, md.block_tables[:B],
                                                      md.seq_lens_tensor[:B], self.scale)
        k, v = _gather_blocks(layer_cache, index.decode_blocks, B)  # (B, S, n_kv_heads, head_dim)
        # The query heads that share a KV head become that head's query rows: each K/V head is read
        # once instead of once per query head (~2x faster than enable_gqa). No causal mask is needed,
        # since every row sits at the newest position.
        out = F.scaled_dot_product_attention(
            q.view(B, self.n_kv_heads, group, self.head_dim),  # (B, n_kv_heads, group, head_dim)
            k.transpose(1, 2).to(q.dtype),  # (B, n_kv_heads, S, head_dim)
            v.transpose(1, 2).to(q.dtype),
            attn_mask=index.decode_mask.to(q.dtype),  # (B, 1, 1, S)
            scale=self.scale,
        )
        return out.reshape(B, self.n_heads, self.head_dim)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal_offset: int) -> torch.Tensor:
        """One sequence. q: (L, n_heads, hd); k, v: (S, n_kv, hd), S = L + causal_offset."""
        L, S = q.shape[0], k.shape[0]
        mask = None
        if causal_offset:  # query j sits at position causal_offset + j and sees keys 0..causal_offset + j
            key_pos = torch.arange(S, device=q.device)[None, :]  # (1, S)
            mask = key_pos <= torch.arange(L, device=q.device)[:, None] + causal_offset  # (L, S)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],  # (1, n_heads, L, hd)
            k.transpose(0, 1)[None],  # (1, n_kv_heads, S, hd)
            v.transpose(0, 1)[None],
            attn_mask=mask,
            is_causal=mask is None,
            scale=self.scale,
            enable_gqa=self.n_kv_heads != self.n_heads,
        )
        return out[0].transpose(0, 1)  # (L, n_heads, hd)


def _gather(
    layer_cache: torch.Tensor, block_tables: torch.Tensor, block_size: int, max_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of whole blocks: each (B, n_blocks * block_size, n_kv_heads, head_dim), contiguous."""
    B, n_blocks = block_tables.shape[0], -(-max_len // block_size)
    return _gather_blocks(layer_cache, block_tables[:, :n_blocks].reshape(-1), B)


def _gather_blocks(layer_cache: torch.Tensor, ids: torch.Tensor, B: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ids: (B * n_blocks,) -> K and V, each (B, n_blocks * block_size, n_kv_heads, head_dim), contiguous."""
    # index_select on dim 0 is a plain block copy, much faster than advanced indexing of the view
    k = layer_cache[:, 0].index_select(0, ids)  # (B * n_blocks, block_size, n_kv_heads, head_dim)
    v = layer_cache[:, 1].index_select(0, ids)
    return k.view(B, -1, *k.shape[-2:]), v.view(B, -1, *v.shape[-2:])
