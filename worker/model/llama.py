"""Llama-family decoder (Llama, Qwen2, Mistral) in plain PyTorch, reading a paged KV cache.

Module and parameter names follow the Hugging Face checkpoints, so a state dict loads as is.
The batch is flat: T tokens from several requests, concatenated (see AttentionMetadata).
Attention layers find the step's metadata and the KV cache through get_forward_context().
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from disagg.worker.runner.forward_context import AttentionMetadata, ForwardContext, get_forward_context
from disagg.worker.model.config import ModelConfig, RopeScaling


def _onednn_linear_op():
    """torch's oneDNN linear kernel (the one torch.compile uses on CPU), or None if this build lacks it
    or it does not behave as expected (a private op: checked once on a tiny input, never trusted blindly)."""
    if not torch.backends.mkldnn.is_available():
        return None
    op = getattr(torch.ops.mkldnn, "_linear_pointwise", None)
    if op is None:
        return None
    try:
        x, w, b = torch.arange(8.0).view(2, 4), torch.ones(3, 4), torch.tensor([1.0, 2.0, 3.0])
        if torch.equal(op(x, w, b, "none", [], ""), F.linear(x, w, b)):
            return op
    except Exception:  # noqa: BLE001 - another torch version: use F.linear
        pass
    return None


class Linear(nn.Linear):
    """nn.Linear (same parameters and state dict) that runs float32 CPU inference through oneDNN.

    On the CPU measured (AMD EPYC, 2 cores) oneDNN's float32 GEMM beat the MKL sgemm behind
    F.linear: 1.2-1.6x on isolated layers, ~10% on decode steps and ~5% on a 4k-token prefill in
    the engine. It reads the plain weight (no packed copy); results differ only in rounding."""

    _onednn = _onednn_linear_op()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if (
            self._onednn is None
            or torch.is_grad_enabled()  # the oneDNN op has no autograd formula
            or x.device.type != "cpu"
            or x.dtype != torch.float32
            or w.dtype != torch.float32
        ):
            return F.linear(x, w, self.bias)
        return self._onednn(x, w, self.bias, "none", [], "")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # normalise in float32, scale in the model dtype (as the reference implementation does)
        x32 = x.float()
        inv_rms = x32.pow(2).mean(-1, keepdim=True).add_(self.eps).rsqrt_()  # (T, 1)
        normed = (x32 * inv_rms).to(x.dtype)  # a fresh tensor either way, so scale it in place
        return normed.mul_(self.weight)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """(head_dim // 2,) float32 inverse frequencies, with linear or llama3 scaling applied."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim))
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    # llama3: keep high frequencies, divide low ones by `factor`, interpolate in between
    low_freq_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_freq_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, theta: float, scaling: RopeScaling | None):
        super().__init__()
        # Not a buffer: Module.to(dtype) would round it to bfloat16, and the loader builds the
        # model on the meta device. Kept float32 on cpu; cos/sin tables are built per device and dtype.
        self._inv_freq = rope_inv_freq(head_dim, theta, scaling)
        self._tables: dict[tuple[torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (T,) -> cos, sin: (T, 1, head_dim / 2); both halves of a head share them."""
        cos, sin = self._table(positions, dtype)
        return cos.index_select(0, positions)[:, None, :], sin.index_select(0, positions)[:, None, :]

    def _table(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for positions 0..n-1: (n, head_dim / 2), grown (doubling) to cover max(positions)."""
        key = (positions.device, dtype)
        table = self._tables.get(key)
        needed = int(positions.max()) + 1 if positions.numel() else 1
        if table is None or table[0].shape[0] < needed:
            n = max(needed, 2 * table[0].shape[0] if table is not None else 1024)
            inv_freq = self._inv_freq.to(positions.device)
            # the same float32 products as computing them per step, so values are identical
            freqs = torch.arange(n, device=positions.device).float()[:, None] * inv_freq[None, :]
            table = self._tables[key] = (freqs.cos().to(dtype), freqs.sin().to(dtype))
        return table


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (T, n_heads, head_dim); cos, sin: (T, 1, head_dim / 2). Rotate-half form, out of place:
    [x1 * cos - x2 * sin, x2 * cos + x1 * sin] (equal to x * cos + rotate_half(x) * sin)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    out = torch.empty_like(x)
    o1, o2 = out[..., :half], out[..., half:]
    torch.mul(x1, cos, out=o1)
    o1.sub_(x2 * sin)
    torch.mul(x2, cos, out=o2)
    o2.add_(x1 * sin)
    return out


@dataclass
class PagedIndex:
    """Index tensors of one step, shared by every attention layer (built once, cached in ctx.extra)."""

    kv_rows: torch.Tensor  # (layers, 2, T) row of each new token's K and V in the cache viewed as (rows, n_kv * hd)
    decode_blocks: torch.Tensor  # (B_dec * n_blocks,) block ids of the decodes, padded to the longest
    decode_mask: torch.Tensor  # (B_dec, 1, 1, n_blocks * block_size) additive: 0 in context, -inf past it

    @staticmethod
    def build(md: AttentionMetadata, kv_cache: torch.Tensor) -> PagedIndex:
        num_layers, bs = kv_cache.shape[1], md.block_size
        dev = md.slot_mapping.device
        block_ids = torch.div(md.slot_mapping, bs, rounding_mode="floor")  # (T,)
        # cache (num_blocks, layers, 2, block_size, ...): row = ((block * layers + layer) * 2 + kv) * bs + offset
        slot_rows = block_ids * (num_layers * 2 * bs) + md.slot_mapping % bs  # (T,) layer 0, K
        layer_kv = torch.arange(num_layers * 2, device=dev).view(num_layers, 2, 1) * bs  # (layers, 2, 1)
        B = md.num_decodes
        n_blocks = -(-max(md.seq_lens[:B], default=0) // bs)
        decode_blocks = md.block_tables[:B, :n_blocks].reshape(-1)  # (B * n_blocks,)
        key_pos = torch.arange(n_blocks * bs, device=dev)  # (S,)
        in_context = key_pos[None, :] < md.seq_lens_tensor[:B, None]  # (B, S)
        # additive float mask, as SDPA would make from the bool one, made once instead of in every layer
        mask = torch.zeros(in_context.shape, dtype=kv_cache.dtype, device=dev).masked_fill_(~in_context, -math.inf)
        return PagedIndex(slot_rows + layer_kv, decode_blocks, mask[:, None, None, :])


def paged_index(ctx: ForwardContext) -> PagedIndex:
    """The step's PagedIndex, built by the first layer that asks when ctx.extra can hold it."""
    if ctx.extra is None:
        return PagedIndex.build(ctx.attn_metadata, ctx.kv_cache)
    index = ctx.extra.get("paged_index")
    if index is None:
        index = ctx.extra["paged_index"] = PagedIndex.build(ctx.attn_metadata, ctx.kv_cache)
    return index


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.layer_name = f"model.layers.{layer_idx}.self_attn"
        self.n_heads = config.num_attention_heads
        self.n_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = self.head_dim**-0.5
        d = config.hidden_size
        self.q_proj = Linear(d, self.n_heads * self.head_dim, bias=config.qkv_bias)
        self.k_proj = Linear(d, self.n_kv_heads * self.head_dim, bias=config.qkv_bias)
        self.v_proj = Linear(d, self.n_kv_heads * self.head_dim, bias=config.qkv_bias)
        self.o_proj = Linear(self.n_heads * self.head_dim, d, bias=config.o_bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        T = x.shape[0]
        q = self.q_proj(x).view(T, self.n_heads, self.head_dim)  # (T, n_heads, head_dim)
        k = self.k_proj(x).view(T, self.n_kv_heads, self.head_dim)  # (T, n_kv_heads, head_dim)
        v = self.v_proj(x).view(T, self.n_kv_heads, self.head_dim)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)

        ctx = get_forward_context()
        if ctx.attn_metadata is None:
            out = self._attend(q, k, v, causal_offset=0)  # dummy run: one causal sequence, no cache
        else:
            out = self._paged_attention(ctx, q, k, v)
        return self.o_proj(out.reshape(T, self.n_heads * self.head_dim))

    def _paged_attention(self, ctx: ForwardContext, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        md = ctx.attn_metadata
        kv_cache = ctx.kv_cache
        if kv_cache is None:
            raise ValueError(f"{self.layer_name}: attn_metadata is set but kv_cache is None")
        if ctx.kv_connector is not None:
            ctx.kv_connector.wait_for_layer_load(self.layer_name)
        index = paged_index(ctx)
        self._write_kv(kv_cache, md, index, k, v)
        if ctx.kv_connector is not None:
            ctx.kv_connector.save_kv_layer(self.layer_name, kv_cache, md)

        layer_cache = kv_cache[:, self.layer_idx]  # (num_blocks, 2, block_size, n_kv_heads, head_dim) view
        n_dec = md.num_decodes
        if n_dec == len(md.seq_lens):
            return self._decode_attention(index, layer_cache, q)
        out = torch.empty_like(q)  # (T, n_heads, head_dim)
        if n_dec:
            out[:n_dec] = self._decode_attention(index, layer_cache, q[:n_dec])
        for i in range(n_dec, len(md.seq_lens)):
            start, end = md.query_start_loc[i], md.query_start_loc[i + 1]
            seq_len, q_len = md.seq_lens[i], end - start
            if seq_len == q_len:  # nothing cached before this chunk: use the fresh K/V directly
                k_ctx, v_ctx = k[start:end], v[start:end]
            else:
                k_ctx, v_ctx = self._gather(layer_cache, md.block_tables[i : i + 1], md.block_size, seq_len)
                k_ctx, v_ctx = k_ctx[0, :seq_len].to(q.dtype), v_ctx[0, :seq_len].to(q.dtype)
            out[start:end] = self._attend(q[start:end], k_ctx, v_ctx, causal_offset=seq_len - q_len)
        return out

    def _write_kv(
        self, kv_cache: torch.Tensor, md: AttentionMetadata, index: PagedIndex, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Store the new tokens' K and V (T, n_kv_heads, head_dim) at their slots of this layer."""
        T = k.shape[0]
        if not kv_cache.is_contiguous():  # a flat row view needs a contiguous cache: index the 6-d view
            block_ids = torch.div(md.slot_mapping, md.block_size, rounding_mode="floor")  # (T,)
            offsets = md.slot_mapping % md.block_size  # (T,)
            layer_cache = kv_cache[:, self.layer_idx]  # (num_blocks, 2, block_size, n_kv_heads, head_dim)
            layer_cache[block_ids, :, offsets] = torch.stack((k, v), dim=1).to(kv_cache.dtype)  # (T, 2, n_kv, hd)
            return
        rows = kv_cache.view(-1, k.shape[1] * k.shape[2])  # (num_blocks * layers * 2 * block_size, n_kv * hd)
        k_rows, v_rows = index.kv_rows[self.layer_idx]  # (T,) each
        # index_copy_ of whole rows: much cheaper than advanced-index assignment into the 6-d cache
        rows.index_copy_(0, k_rows, k.reshape(T, -1).to(kv_cache.dtype))
        rows.index_copy_(0, v_rows, v.reshape(T, -1).to(kv_cache.dtype))

    def _decode_attention(self, index: PagedIndex, layer_cache: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        """All single-token requests in one batched op. q: (B, n_heads, head_dim)."""
        B, group = q.shape[0], self.n_heads // self.n_kv_heads
        k, v = self._gather_blocks(layer_cache, index.decode_blocks, B)  # (B, S, n_kv_heads, head_dim)
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

    @staticmethod
    def _gather(
        layer_cache: torch.Tensor, block_tables: torch.Tensor, block_size: int, max_len: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of whole blocks: each (B, n_blocks * block_size, n_kv_heads, head_dim), contiguous."""
        B, n_blocks = block_tables.shape[0], -(-max_len // block_size)
        return Attention._gather_blocks(layer_cache, block_tables[:, :n_blocks].reshape(-1), B)

    @staticmethod
    def _gather_blocks(layer_cache: torch.Tensor, ids: torch.Tensor, B: int) -> tuple[torch.Tensor, torch.Tensor]:
        """ids: (B * n_blocks,) -> K and V, each (B, n_blocks * block_size, n_kv_heads, head_dim), contiguous."""
        # index_select on dim 0 is a plain block copy, much faster than advanced indexing of the view
        k = layer_cache[:, 0].index_select(0, ids)  # (B * n_blocks, block_size, n_kv_heads, head_dim)
        v = layer_cache[:, 1].index_select(0, ids)
        return k.view(B, -1, *k.shape[-2:]), v.view(B, -1, *v.shape[-2:])

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


class FeedForward(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        d, h, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = Linear(d, h, bias=bias)
        self.up_proj = Linear(d, h, bias=bias)
        self.down_proj = Linear(h, d, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # in place on the fresh projection outputs: no (T, intermediate) temporaries
        hidden = F.silu(self.gate_proj(x), inplace=True).mul_(self.up_proj(x))  # (T, intermediate)
        return self.down_proj(hidden)


class TransformerBlock(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = FeedForward(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: (T, hidden), the residual stream, updated in place and returned (LlamaModel owns it)."""
        x = x.add_(self.self_attn(self.input_layernorm(x), cos, sin))
        return x.add_(self.mlp(self.post_attention_layernorm(x)))


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(TransformerBlock(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # (T, hidden)
        cos, sin = self.rotary(positions, x.dtype)  # (T, 1, head_dim)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.norm(x)


class CausalLM(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: (T,) int64 -> hidden states (T, hidden)."""
        return self.model(input_ids, positions)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: (N, hidden) -> logits (N, vocab) float32."""
        return self.lm_head(hidden).float()
