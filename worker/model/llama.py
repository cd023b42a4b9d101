"""Llama-family decoder (Llama, Qwen2, Mistral) in plain PyTorch, reading a paged KV cache.

Module and parameter names follow the Hugging Face checkpoints, so a state dict loads as is.
The batch is flat: T tokens from several requests, concatenated (see AttentionMetadata).
Attention reads and writes the paged KV cache through paged_attention.PagedAttention, which finds
the step's metadata and the KV cache through get_forward_context().
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from disagg.worker.model import cpu_kernels
from disagg.worker.model.config import ModelConfig, RopeScaling
from disagg.worker.model.paged_attention import PagedAttention


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


def _onednn_reorder_op():
    """torch's oneDNN weight packing for that linear kernel (mkldnn::_reorder_linear_weight, the layout
    torch.compile's frozen CPU graphs use), or None; checked once like the kernel itself."""
    linear, op = _onednn_linear_op(), getattr(torch.ops.mkldnn, "_reorder_linear_weight", None)
    if linear is None or op is None:
        return None
    try:
        x, w = torch.arange(32.0).view(8, 4), torch.arange(12.0).view(3, 4)
        if torch.equal(linear(x, op(w, None), None, "none", [], ""), F.linear(x, w)):
            return op
    except Exception:  # noqa: BLE001 - another torch version: keep the plain weight
        pass
    return None


class Linear(nn.Linear):
    """nn.Linear (same parameters and state dict) that runs float32 CPU inference through oneDNN.

    On the CPU measured (AMD EPYC, 2 cores) oneDNN's float32 GEMM beat the MKL sgemm behind
    F.linear: 1.2-1.6x on isolated layers, ~10% on decode steps and ~5% on a 4k-token prefill in
    the engine. It reads the plain weight (no packed copy); results differ only in rounding."""

    _onednn = _onednn_linear_op()
    _reorder = _onednn_reorder_op()
    _packed: torch.Tensor | None = None  # the weight in oneDNN's blocked layout, once pack_weight() ran

    def pack_weight(self) -> bool:
        """For float32 CPU inference: hold the weight in oneDNN's blocked layout instead of the plain
        one (the plain parameter is dropped: no second copy). Decode's small-batch GEMMs stream it
        from memory faster: 2.3 against 3.1 ms for the 16 GEMMs of one step of the bench model
        (48 MB of weights, 32 tokens), equal results for 7+ rows, and no slower for prefill.
        False (nothing changed) where the kernel or the packing is unavailable, or off CPU/float32."""
        w = self.weight
        if self._reorder is None or w is None or w.device.type != "cpu" or w.dtype != torch.float32:
            return False
        self._packed = self._reorder(w.detach(), None)
        self.weight = None
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._packed is not None:
            if x.device.type != "cpu" or x.dtype != torch.float32 or torch.is_grad_enabled():
                raise RuntimeError(f"{type(self).__name__}: its weight is packed for float32 CPU inference; "
                                   f"got a {x.dtype} input on {x.device} (grad enabled: {torch.is_grad_enabled()})")
            return self._onednn(x, self._packed, self.bias, "none", [], "")
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

    def split_forward(self, x: torch.Tensor, parts: int) -> list[torch.Tensor]:
        """The output in `parts` equal column groups, each from its own GEMM over a row slice of the
        weight (a view): for many tokens one wide output (T, N) ran slower than the separate narrower
        ones (cache traffic; 57 vs 70 ms for 4300 x 512 -> 3072 on this CPU), for few it is faster."""
        n = self.weight.shape[0] // parts
        outs = []
        for i in range(parts):
            w = self.weight[i * n:(i + 1) * n]
            b = None if self.bias is None else self.bias[i * n:(i + 1) * n]
            if self._onednn is None or torch.is_grad_enabled() or x.device.type != "cpu" or x.dtype != torch.float32:
                outs.append(F.linear(x, w, b))
            else:
                outs.append(self._onednn(x, w, b, "none", [], ""))
        return outs


# above this many tokens a fused projection runs as its separate GEMMs again (see Linear.split_forward)
FUSED_GEMM_MAX_TOKENS = 512


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, delta: torch.Tensor | None = None) -> torch.Tensor:
        """RMSNorm(x) * weight; with delta, x += delta first (in place: x is the residual stream)."""
        if cpu_kernels.can_norm(x, self.weight, delta):  # the add and the norm in one pass
            return cpu_kernels.add_rms_norm(x, self.weight, self.eps, delta)
        if delta is not None:
            x.add_(delta)
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # torch's fused kernel: the same float32 arithmetic in one pass instead of five (results
            # compared bit-equal on this build; 2-7x faster); other dtypes scale after rounding below
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
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

    def for_step(self, positions: torch.Tensor, dtype: torch.dtype) -> Rope:
        return Rope(positions, *self._table(positions, dtype))

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


@dataclass
class Rope:
    """One step's rotary embedding, shared by every layer: the tokens' positions and the cos/sin tables
    (n, head_dim / 2). The C kernel reads the tables at the positions; torch's path gathers them once."""

    positions: torch.Tensor
    cos_table: torch.Tensor
    sin_table: torch.Tensor
    _gathered: tuple[torch.Tensor, torch.Tensor] | None = None

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """x: (T, heads, head_dim) -> rotated, a new tensor."""
        if cpu_kernels.can_rotate(x, self.cos_table):
            return cpu_kernels.rotary(x, self.positions, self.cos_table, self.sin_table)
        if self._gathered is None:
            p = self.positions
            self._gathered = (self.cos_table.index_select(0, p)[:, None, :], self.sin_table.index_select(0, p)[:, None, :])
        return apply_rotary(x, *self._gathered)


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


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.n_heads = config.num_attention_heads
        self.n_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        d = config.hidden_size
        self.q_proj = Linear(d, self.n_heads * self.head_dim, bias=config.qkv_bias)
        self.k_proj = Linear(d, self.n_kv_heads * self.head_dim, bias=config.qkv_bias)
        self.v_proj = Linear(d, self.n_kv_heads * self.head_dim, bias=config.qkv_bias)
        self.o_proj = Linear(self.n_heads * self.head_dim, d, bias=config.o_bias)
        self.attn = PagedAttention(layer_idx, f"model.layers.{layer_idx}.self_attn", self.n_heads,
                                   self.n_kv_heads, self.head_dim)

    def fuse_projections(self) -> None:
        """Replace q/k/v_proj by one qkv_proj over their concatenated weights (after loading: the
        checkpoint's names stay the load-time parameters). One GEMM instead of three reads the input
        once, and one rotary pass then covers q and k, which sit side by side in its output."""
        self.qkv_proj = _fused_linear([self.q_proj, self.k_proj, self.v_proj])
        del self.q_proj, self.k_proj, self.v_proj

    def forward(self, x: torch.Tensor, rope: Rope) -> torch.Tensor:
        T = x.shape[0]
        nq, nkv, hd = self.n_heads, self.n_kv_heads, self.head_dim
        if hasattr(self, "qkv_proj"):
            qkv = self.qkv_proj(x).view(T, nq + 2 * nkv, hd)  # (T, q heads | k heads | v heads, head_dim)
            qk = rope.apply(qkv[:, : nq + nkv])  # (T, nq + nkv, head_dim)
            q, k, v = qk[:, :nq], qk[:, nq:], qkv[:, nq + nkv:]
        else:
            q = self.q_proj(x).view(T, nq, hd)  # (T, n_heads, head_dim)
            k = self.k_proj(x).view(T, nkv, hd)  # (T, n_kv_heads, head_dim)
            v = self.v_proj(x).view(T, nkv, hd)
            q, k = rope.apply(q), rope.apply(k)
        out = self.attn(q, k, v)  # (T, n_heads, head_dim)
        return self.o_proj(out.reshape(T, nq * hd))


class FeedForward(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        d, h, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = Linear(d, h, bias=bias)
        self.up_proj = Linear(d, h, bias=bias)
        self.down_proj = Linear(h, d, bias=bias)

    def fuse_projections(self) -> None:
        """Replace gate_proj and up_proj by one gate_up_proj (after loading), one GEMM instead of two."""
        self.gate_up_proj = _fused_linear([self.gate_proj, self.up_proj])
        del self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "gate_up_proj"):
            # a packed weight cannot be sliced; its one GEMM measured level with the split plain ones
            if x.shape[0] <= FUSED_GEMM_MAX_TOKENS or self.gate_up_proj._packed is not None:
                gate_up = self.gate_up_proj(x)  # (T, 2 * intermediate)
                h = gate_up.shape[-1] // 2
                # silu into a fresh contiguous tensor, then in place: an in-place silu on the strided half
                # handed down_proj a strided input, which it copied first (5.5 ms a layer at 4.8k tokens)
                hidden = F.silu(gate_up[:, :h]).mul_(gate_up[:, h:])
            else:
                gate, up = self.gate_up_proj.split_forward(x, 2)
                hidden = F.silu(gate, inplace=True).mul_(up)
        else:
            hidden = F.silu(self.gate_proj(x), inplace=True).mul_(self.up_proj(x))  # (T, intermediate)
        return self.down_proj(hidden)


def _fused_linear(parts: list[nn.Linear]) -> Linear:
    """One Linear whose output is the parts' outputs side by side (weights and biases concatenated)."""
    w = torch.cat([p.weight for p in parts])
    fused = Linear(w.shape[1], w.shape[0], bias=parts[0].bias is not None, device="meta")
    fused.weight = nn.Parameter(w, requires_grad=False)
    if fused.bias is not None:
        fused.bias = nn.Parameter(torch.cat([p.bias for p in parts]), requires_grad=False)
    return fused


class TransformerBlock(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = FeedForward(config)

    def forward(self, x: torch.Tensor, delta: torch.Tensor | None, rope: Rope) -> tuple[torch.Tensor, torch.Tensor]:
        """x: (T, hidden), the residual stream, updated in place (LlamaModel owns it); delta: the previous
        block's MLP output, not yet added (each add happens inside the next norm, in one pass with it).
        Returns x and this block's MLP output."""
        attn = self.self_attn(self.input_layernorm(x, delta), rope)
        return x, self.mlp(self.post_attention_layernorm(x, attn))


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(TransformerBlock(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # (T, hidden), a fresh tensor: the residual stream
        rope = self.rotary.for_step(positions, x.dtype)
        delta = None
        for layer in self.layers:
            x, delta = layer(x, delta, rope)
        return self.norm(x, delta)


class CausalLM(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def fuse_projections(self) -> None:
        """Fuse each layer's q/k/v and gate/up projections (the loader calls it once the weights are in)."""
        for layer in self.model.layers:
            layer.self_attn.fuse_projections()
            layer.mlp.fuse_projections()

    def pack_weights(self) -> int:
        """Pack every linear layer's weight for float32 CPU inference (see Linear.pack_weight), except
        an lm_head tied to the embeddings, whose plain matrix the embedding lookup reads. After this the
        model serves inference only. Returns how many layers were packed."""
        tied = self.lm_head.weight is self.model.embed_tokens.weight
        return sum(m.pack_weight() for m in self.modules()
                   if isinstance(m, Linear) and not (tied and m is self.lm_head))

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: (T,) int64 -> hidden states (T, hidden)."""
        return self.model(input_ids, positions)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: (N, hidden) -> logits (N, vocab) float32."""
        return self.lm_head(hidden).float()
