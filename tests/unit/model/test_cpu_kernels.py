"""The C kernels of worker/model/cpu_kernels.py against the torch ops they replace, and their fallbacks."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from disagg.worker.model import cpu_kernels
from disagg.worker.model.llama import Linear, RMSNorm, apply_rotary
from disagg.worker.model.paged_attention import _gather_blocks

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler: the kernels fall back to torch")


def torch_decode_attention(q, cache, layer, tables, lens, scale):
    """The torch path: gather each sequence's blocks, mask past its length, SDPA per kv head group."""
    B, nh, hd = q.shape
    nkv, bs = cache.shape[4], cache.shape[3]
    n_blocks = -(-int(lens.max()) // bs)
    k, v = _gather_blocks(cache[:, layer], tables[:, :n_blocks].reshape(-1), B)
    pos = torch.arange(n_blocks * bs)
    mask = torch.zeros(B, n_blocks * bs).masked_fill_(pos[None] >= lens[:, None], -math.inf)[:, None, None]
    out = F.scaled_dot_product_attention(q.view(B, nkv, nh // nkv, hd), k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=mask, scale=scale)
    return out.reshape(B, nh, hd)


@pytest.mark.parametrize("n_heads,n_kv,head_dim", [(8, 2, 64), (4, 4, 32), (16, 2, 128), (6, 1, 16)])
def test_paged_decode_attention_matches_gather_and_sdpa(n_heads, n_kv, head_dim):
    g = torch.Generator().manual_seed(n_heads * head_dim)
    num_blocks, layers, bs = 64, 3, 4
    cache = torch.randn(num_blocks, layers, 2, bs, n_kv, head_dim, generator=g)
    lens = torch.tensor([1, 4, 5, 13, 16, 31])  # one token, whole blocks, partial blocks
    max_blocks = 8
    tables = torch.randperm(num_blocks, generator=g)[: len(lens) * max_blocks].view(len(lens), max_blocks)
    q = torch.randn(len(lens), n_heads, head_dim, generator=g)
    for layer in range(layers):
        got = cpu_kernels.paged_decode_attention(q, cache, layer, tables, lens, head_dim**-0.5)
        want = torch_decode_attention(q, cache, layer, tables, lens, head_dim**-0.5)
        torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


def test_paged_decode_attention_rejects_a_length_past_its_block_table():
    cache = torch.randn(8, 1, 2, 4, 1, 16)
    with pytest.raises(ValueError, match="sequence length outside 1..8"):
        cpu_kernels.paged_decode_attention(torch.randn(1, 1, 16), cache, 0, torch.tensor([[0, 1]]),
                                           torch.tensor([9]), 0.25)


def qkv_views(T, n_heads, n_kv, head_dim, g):
    """q, k, v as the model has them: strided views of one fused projection's output."""
    qkv = torch.randn(T, (n_heads + 2 * n_kv) * head_dim, generator=g).view(T, n_heads + 2 * n_kv, head_dim)
    return qkv[:, :n_heads], qkv[:, n_heads:n_heads + n_kv], qkv[:, n_heads + n_kv:]


@pytest.mark.parametrize("n_heads,n_kv,head_dim", [(8, 2, 64), (4, 4, 128), (12, 1, 64), (64, 1, 64), (2, 1, 256)])
def test_prefill_attention_matches_causal_sdpa_per_sequence(n_heads, n_kv, head_dim):
    g = torch.Generator().manual_seed(n_heads * head_dim)
    # one token, tile and key-block edges (16 positions x group 4 = a tile; 64 keys a block), long ones
    lens = [1, 5, 16, 17, 63, 64, 65, 130, 300]
    T = sum(lens) + 7
    q, k, v = qkv_views(T, n_heads, n_kv, head_dim, g)
    starts = [7 + sum(lens[:i]) for i in range(len(lens))]  # token 0..6 belong to no sequence: left alone
    out = torch.full((T, n_heads, head_dim), 123.0)
    assert cpu_kernels.supports_prefill(q, k, v)
    cpu_kernels.prefill_attention(q, k, v, starts, lens, head_dim**-0.5, out)
    assert torch.equal(out[:7], torch.full((7, n_heads, head_dim), 123.0))
    for s, n in zip(starts, lens):
        want = F.scaled_dot_product_attention(q[s:s + n].transpose(0, 1)[None], k[s:s + n].transpose(0, 1)[None],
                                              v[s:s + n].transpose(0, 1)[None], is_causal=True,
                                              scale=head_dim**-0.5, enable_gqa=n_kv != n_heads)
        torch.testing.assert_close(out[s:s + n], want[0].transpose(0, 1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n_heads,n_kv,head_dim", [(8, 2, 64), (4, 4, 128)])
def test_paged_prefill_attention_continues_a_cached_prefix_read_from_the_blocks(n_heads, n_kv, head_dim):
    g = torch.Generator().manual_seed(7 * n_heads)
    num_blocks, layers, bs, max_blocks = 96, 2, 16, 12
    cache = torch.randn(num_blocks, layers, 2, bs, n_kv, head_dim, generator=g)
    # (cached prefix, chunk): a one-block hit, a chunk ending mid-block, a one-token chunk, a long tail
    chunks = [(16, 40), (5, 11), (100, 1), (64, 120)]
    tables = torch.randperm(num_blocks, generator=g)[: len(chunks) * max_blocks].view(len(chunks), max_blocks)
    T = sum(n for _, n in chunks)
    q = torch.randn(T, n_heads, head_dim, generator=g)
    starts = [sum(n for _, n in chunks[:i]) for i in range(len(chunks))]
    for layer in range(layers):
        out = torch.zeros(T, n_heads, head_dim)
        cpu_kernels.paged_prefill_attention(q, cache, layer, tables, starts, [n for _, n in chunks],
                                            [c for c, _ in chunks], head_dim**-0.5, out)
        for (ctx, n), s, table in zip(chunks, starts, tables):
            k, v = _gather_blocks(cache[:, layer], table, 1)  # (1, max_blocks * bs, n_kv, head_dim)
            k, v = k[0, :ctx + n].transpose(0, 1)[None], v[0, :ctx + n].transpose(0, 1)[None]
            mask = torch.arange(ctx + n)[None, :] <= torch.arange(n)[:, None] + ctx  # position ctx + i sees 0..
            want = F.scaled_dot_product_attention(q[s:s + n].transpose(0, 1)[None], k, v, attn_mask=mask,
                                                  scale=head_dim**-0.5, enable_gqa=n_kv != n_heads)
            torch.testing.assert_close(out[s:s + n], want[0].transpose(0, 1), rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="past its block"):  # a chunk longer than its block table holds
        cpu_kernels.paged_prefill_attention(q, cache, 0, tables[:1], [0], [40], [max_blocks * bs - 39],
                                            head_dim**-0.5, torch.zeros(T, n_heads, head_dim))


def test_prefill_attention_refuses_what_it_cannot_serve():
    g = torch.Generator().manual_seed(0)
    q, k, v = qkv_views(10, 4, 2, 32, g)  # head_dim not a multiple of 64: SDPA serves it
    assert not cpu_kernels.supports_prefill(q, k, v)
    q, k, v = qkv_views(10, 4, 2, 64, g)
    assert not cpu_kernels.supports_prefill(q.double(), k.double(), v.double())
    with pytest.raises(ValueError, match="outside 10 tokens"):
        cpu_kernels.prefill_attention(q, k, v, [4], [7], 0.125, torch.empty(10, 4, 64))
    with pytest.raises(ValueError, match="must be contiguous"):
        cpu_kernels.prefill_attention(q, k, v, [0], [10], 0.125, torch.empty(10, 64, 4).transpose(1, 2))


def test_write_kv_rows_matches_index_copy_and_writes_nothing_on_a_bad_row():
    cache = torch.zeros(6, 2, 2, 4, 2, 8)
    rows = cache.view(-1, 16)
    qkv = torch.randn(5, 6, 8)  # q (2 heads) | k (2) | v (2): k and v are strided slices, as in the model
    k, v = qkv[:, 2:4], qkv[:, 4:]
    k_rows, v_rows = torch.tensor([0, 9, 17, 40, 95]), torch.tensor([4, 13, 21, 44, 91])
    cpu_kernels.write_kv_rows(cache, k_rows, v_rows, k, v)
    want = torch.zeros_like(rows).index_copy_(0, k_rows, k.reshape(5, -1)).index_copy_(0, v_rows, v.reshape(5, -1))
    assert torch.equal(rows, want)
    before = cache.clone()
    with pytest.raises(ValueError, match=r"rows \[96\] outside the cache's 96"):
        cpu_kernels.write_kv_rows(cache, torch.tensor([1, 96, 2, 3, 4]), v_rows, k, v)
    assert torch.equal(cache, before)


def test_add_rms_norm_adds_in_place_and_matches_torch():
    g = torch.Generator().manual_seed(1)
    x, delta, w = torch.randn(70, 96, generator=g), torch.randn(70, 96, generator=g), torch.randn(96, generator=g)
    summed = x + delta
    out = cpu_kernels.add_rms_norm(x, w, 1e-5, delta)
    assert torch.equal(x, summed)  # the residual stream now holds the sum
    torch.testing.assert_close(out, F.rms_norm(summed, (96,), w, 1e-5), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(cpu_kernels.add_rms_norm(x.clone(), w, 1e-5), F.rms_norm(summed, (96,), w, 1e-5),
                               atol=1e-6, rtol=1e-5)
    norm = RMSNorm(96, 1e-5)  # the module: the kernel for float32, torch for other dtypes
    torch.testing.assert_close(norm(x.double()), F.rms_norm(x.double(), (96,), norm.weight.double(), 1e-5))


def test_rotary_matches_apply_rotary_on_strided_heads():
    g = torch.Generator().manual_seed(2)
    qkv = torch.randn(9, 5, 16, generator=g)
    x = qkv[:, :4]  # q and k heads of a fused projection: a strided view
    cos, sin = torch.randn(40, 8, generator=g), torch.randn(40, 8, generator=g)
    positions = torch.tensor([0, 3, 39, 7, 7, 12, 1, 2, 30])
    got = cpu_kernels.rotary(x, positions, cos, sin)
    want = apply_rotary(x, cos[positions][:, None], sin[positions][:, None])
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    with pytest.raises(ValueError, match="positions outside the table's 0..39: \\[40\\]"):
        cpu_kernels.rotary(x, torch.tensor([0, 1, 2, 3, 40, 5, 6, 7, 8]), cos, sin)


def test_packed_linear_equals_plain_and_refuses_other_dtypes():
    if Linear._reorder is None:
        pytest.skip("this torch has no oneDNN weight packing")
    torch.manual_seed(3)
    plain = Linear(64, 48)
    packed = Linear(64, 48)
    packed.load_state_dict(plain.state_dict())
    assert packed.pack_weight() and packed.weight is None  # no second copy of the weight
    x = torch.randn(33, 64)
    with torch.inference_mode():
        assert torch.equal(packed(x), plain(x))
        with pytest.raises(RuntimeError, match="packed for float32 CPU inference; got a torch.float64 input"):
            packed(x.double())


def test_no_compiler_falls_back_to_torch(monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(cpu_kernels, "_loaded", {})
    monkeypatch.setenv("DISAGG_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with caplog.at_level("WARNING"):
        assert cpu_kernels.load() is None
    assert "CPU kernels unavailable" in caplog.text and "decode attention gathers K/V" in caplog.text
    assert not cpu_kernels.supports(torch.randn(2, 4, 16), torch.randn(4, 1, 2, 4, 2, 16), 2)
    monkeypatch.setattr(cpu_kernels, "_loaded", {})
    monkeypatch.setenv("DISAGG_CPU_KERNELS", "0")
    monkeypatch.delenv("CC")
    assert cpu_kernels.load() is None and not list(tmp_path.iterdir())


def test_builds_into_its_cache_once(monkeypatch, tmp_path):
    monkeypatch.setattr(cpu_kernels, "_loaded", {})
    monkeypatch.setenv("DISAGG_KERNEL_CACHE", str(tmp_path))
    assert cpu_kernels.load() is not None
    built = list(tmp_path.glob("paged_kv-*.so"))
    assert len(built) == 1
    mtime = built[0].stat().st_mtime_ns
    monkeypatch.setattr(cpu_kernels, "_loaded", {})
    assert cpu_kernels.load() is not None and built[0].stat().st_mtime_ns == mtime  # loaded, not rebuilt
