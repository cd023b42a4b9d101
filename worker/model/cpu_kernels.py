"""Kernels of our own for float32 CPU inference, in C (csrc/paged_kv.c), built with the host's C compiler.

torch has no attention op that reads a paged KV cache in place, so decode attention over the cache
had to gather every sequence's K and V blocks into a dense copy first (two index_selects per layer
and step) and hand that to SDPA. `paged_decode_attention` reads the blocks where they lie: 0.9 against
2.2 ms per decode step of the bench model (32 sequences of ~300 tokens, 4 layers). `write_kv_rows`
stores a step's new K/V rows with a memcpy each, where index_copy_ took 3.5 ms per layer for a
4.8k-token prefill. `add_rms_norm` (a block's residual add and RMSNorm) and `rotary` each make one
pass over the rows where torch's ops made four to six.
`prefill_attention` and `paged_prefill_attention` attend every prompt chunk of a step in one call, the
latter reading a cached prefix (a prefix-cache hit, a chunked prefill's later chunks) where it lies in the
blocks: on the bench model's 32-prompt prefill 7.5 against SDPA's 17-21 ms a layer (one call per sequence),
on 8 prompts of 1-2k tokens 130 against 185 ms.

The source is compiled once per source, flags and CPU (with -march=native: the host's vector units)
into a cache directory, in about a second, and loaded with ctypes; it needs no torch headers. It links
OpenMP, and since torch is imported first, the dynamic linker resolves it to the libgomp torch already
loaded: the kernel runs on torch's own thread pool instead of a second pool competing for the cores.

No compiler, a failed build, or DISAGG_CPU_KERNELS=0: `load()` returns None (logged once) and
attention keeps its torch path, which gives the same results up to float rounding.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "paged_kv.c"
FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-shared", "-fPIC")
_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL | None] = {}

_i64, _f32p, _i64p = ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p


def enabled() -> bool:
    return os.environ.get("DISAGG_CPU_KERNELS", "1").strip().lower() not in ("0", "false", "no", "off")


def cache_dir() -> Path:
    """DISAGG_KERNEL_CACHE, else $XDG_CACHE_HOME/disagg/kernels (default ~/.cache/...)."""
    if os.environ.get("DISAGG_KERNEL_CACHE"):
        return Path(os.environ["DISAGG_KERNEL_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "disagg" / "kernels"


def _cpu_id() -> str:
    """What -march=native depends on: the machine and its CPU feature flags."""
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                flags = line
                break
    except OSError:
        pass
    return platform.machine() + flags


def _build(compiler: str, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        subprocess.run([compiler, *FLAGS, "-o", tmp, str(SOURCE), "-lm"], check=True, capture_output=True,
                       text=True, timeout=120)
        os.replace(tmp, out)  # atomic: concurrent workers never load a half-written library
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load() -> ctypes.CDLL | None:
    """The compiled paged decode attention library, or None where it cannot be had (see module doc)."""
    with _lock:
        if "lib" in _loaded:
            return _loaded["lib"]
        lib = None
        if not enabled():
            logger.info("CPU kernels off (DISAGG_CPU_KERNELS); decode attention gathers K/V for torch's SDPA")
        else:
            compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
            try:
                key = hashlib.sha256(SOURCE.read_bytes() + repr((FLAGS, compiler, _cpu_id())).encode()).hexdigest()
                path = cache_dir() / f"paged_kv-{key[:16]}.so"
                if not path.exists():
                    if compiler is None:
                        raise FileNotFoundError("no C compiler (cc, gcc or $CC) on PATH")
                    _build(compiler, path)
                lib = ctypes.CDLL(str(path))
                fn = lib.disagg_paged_decode_attention
                fn.restype = ctypes.c_int
                fn.argtypes = [_f32p, _f32p, _i64p, _i64, _i64p, _i64, _i64, _i64, _i64, _i64, _i64, _i64, _i64,
                               ctypes.c_float, _f32p]
                lib.disagg_paged_decode_attention_limits.restype = ctypes.c_int
                lib.disagg_paged_decode_attention_limits.argtypes = [_i64, _i64]
                lib.disagg_add_rms_norm.restype = None
                lib.disagg_add_rms_norm.argtypes = [_f32p, _f32p, _f32p, _f32p, _i64, _i64, ctypes.c_float]
                lib.disagg_rotary.restype = ctypes.c_int
                lib.disagg_rotary.argtypes = [_f32p, _i64, _i64p, _f32p, _f32p, _i64, _f32p, _i64, _i64, _i64]
                lib.disagg_prefill_attention.restype = ctypes.c_int
                lib.disagg_prefill_attention.argtypes = [_f32p, _i64, _f32p, _i64, _f32p, _i64, _i64p, _i64p, _i64,
                                                         _i64, _i64, _i64, ctypes.c_float, _f32p]
                lib.disagg_paged_prefill_attention.restype = ctypes.c_int
                lib.disagg_paged_prefill_attention.argtypes = [_f32p, _i64, _f32p, _i64p, _i64, _i64, _i64, _i64,
                                                               _i64, _i64p, _i64p, _i64p, _i64, _i64, _i64, _i64,
                                                               ctypes.c_float, _f32p]
                lib.disagg_prefill_attention_limits.restype = ctypes.c_int
                lib.disagg_prefill_attention_limits.argtypes = [_i64, _i64]
                lib.disagg_write_kv_rows.restype = ctypes.c_int
                lib.disagg_write_kv_rows.argtypes = [_f32p, _i64, _i64, _i64p, _i64p, _i64, _f32p, _i64, _f32p, _i64]
                logger.info("CPU kernels: paged KV kernels loaded from %s", path)
            except (OSError, subprocess.SubprocessError) as e:
                detail = getattr(e, "stderr", "") or ""
                logger.warning("CPU kernels unavailable (%s%s); decode attention gathers K/V for torch's SDPA",
                               e, f": {detail.strip()[:500]}" if detail else "")
                lib = None
        _loaded["lib"] = lib
        return lib


def _cpu_f32(*tensors: torch.Tensor) -> bool:
    return all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors) and load() is not None


def _heads_contiguous(t: torch.Tensor) -> bool:
    """t (T, heads, head_dim) with each token's heads one contiguous run (rows may be strided: a QKV slice)."""
    return t.dim() == 3 and t.stride(2) == 1 and t.stride(1) == t.shape[2]


def can_norm(x: torch.Tensor, weight: torch.Tensor, delta: torch.Tensor | None) -> bool:
    """Whether add_rms_norm can serve x (rows, dim) with this weight (dim,) and delta (x's shape or None)."""
    ts = [x, weight] if delta is None else [x, weight, delta]
    return (x.dim() == 2 and weight.shape == x.shape[-1:] and (delta is None or delta.shape == x.shape)
            and all(t.is_contiguous() for t in ts) and _cpu_f32(*ts))


def add_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, delta: torch.Tensor | None = None) -> torch.Tensor:
    """x += delta (in place, when given), then RMSNorm(x) * weight into a new tensor. Call can_norm() first."""
    out = torch.empty_like(x)
    load().disagg_add_rms_norm(x.data_ptr(), None if delta is None else delta.data_ptr(), weight.data_ptr(),
                               out.data_ptr(), x.shape[0], x.shape[1], eps)
    return out


def can_rotate(x: torch.Tensor, cos_table: torch.Tensor) -> bool:
    """Whether rotary can serve x (T, heads, head_dim), each token's heads contiguous, with this table."""
    return (_heads_contiguous(x) and x.shape[2] % 2 == 0 and cos_table.is_contiguous() and cos_table.shape[-1] == x.shape[2] // 2 and _cpu_f32(x, cos_table))


def rotary(x: torch.Tensor, positions: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary embedding of x (T, heads, head_dim) at positions (T,), tables (n, head_dim / 2)
    -> a new contiguous (T, heads, head_dim) tensor. Call can_rotate() first."""
    T, heads, hd = x.shape
    pos = positions.to(torch.int64).contiguous()
    if pos.shape != (T,) or sin_table.shape != cos_table.shape or not sin_table.is_contiguous():
        raise ValueError(f"rotary: {T} tokens, positions {tuple(pos.shape)}, tables {tuple(cos_table.shape)} "
                         f"and {tuple(sin_table.shape)}")
    out = torch.empty((T, heads, hd), dtype=x.dtype)
    rc = load().disagg_rotary(x.data_ptr(), x.stride(0), pos.data_ptr(), cos_table.data_ptr(), sin_table.data_ptr(),
                              cos_table.shape[0], out.data_ptr(), T, heads, hd)
    if rc:
        raise ValueError(f"rotary: positions outside the table's 0..{cos_table.shape[0] - 1}: "
                         f"{pos[(pos < 0) | (pos >= cos_table.shape[0])].tolist()[:8]}")
    return out


def can_write(k: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Whether write_kv_rows can store k (T, n_kv, head_dim) (and its v alike) into kv_cache."""
    return kv_cache.is_contiguous() and _cpu_f32(k, kv_cache)


def write_kv_rows(kv_cache: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor, k: torch.Tensor,
                  v: torch.Tensor) -> None:
    """kv_cache viewed as rows of n_kv * head_dim floats: k[t] goes to row k_rows[t], v[t] to v_rows[t].
    k, v: (T, n_kv, head_dim), each token's heads contiguous (a slice of the fused QKV output is fine);
    k_rows, v_rows: (T,) int64. Call can_write() first."""
    T, row = k.shape[0], k.shape[1] * k.shape[2]
    for name, t in (("k", k), ("v", v)):
        if t.shape != k.shape or not _heads_contiguous(t):
            raise ValueError(f"write_kv_rows: {name} {tuple(t.shape)} strides {t.stride()}: each token's "
                             f"{k.shape[1]} heads x {k.shape[2]} must be contiguous")
    k_rows, v_rows = k_rows.to(torch.int64).contiguous(), v_rows.to(torch.int64).contiguous()
    if k_rows.shape != (T,) or v_rows.shape != (T,):
        raise ValueError(f"write_kv_rows: {T} tokens, rows {tuple(k_rows.shape)} and {tuple(v_rows.shape)}")
    total = kv_cache.numel() // row
    rc = load().disagg_write_kv_rows(kv_cache.data_ptr(), total, row, k_rows.data_ptr(), v_rows.data_ptr(), T,
                                     k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0))
    if rc:
        bad = torch.cat([k_rows, v_rows])
        raise ValueError(f"write_kv_rows: rows {bad[(bad < 0) | (bad >= total)].tolist()[:8]} outside the "
                         f"cache's {total}")


def supports(q: torch.Tensor, kv_cache: torch.Tensor, n_kv_heads: int) -> bool:
    """Whether paged_decode_attention can serve this layer's decode (else the torch path does)."""
    if not _cpu_f32(q, kv_cache) or not kv_cache.is_contiguous() or q.shape[1] % n_kv_heads:
        return False
    return bool(load().disagg_paged_decode_attention_limits(q.shape[1], q.shape[2]))


def paged_decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, layer_idx: int, block_tables: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q: (B, n_heads, head_dim) float32, one new token per sequence; kv_cache: the whole contiguous
    (num_blocks, num_layers, 2, block_size, n_kv, head_dim) cache; block_tables: (B, max_blocks) int64;
    seq_lens: (B,) int64, each sequence's tokens in cache including this one -> (B, n_heads, head_dim).
    Call supports() first."""
    lib = load()
    B, n_heads, hd = q.shape
    n_kv, block_size = kv_cache.shape[4], kv_cache.shape[3]
    q = q.contiguous()
    tables = block_tables.to(torch.int64).contiguous()
    lens = seq_lens.to(torch.int64).contiguous()
    if tables.shape[0] != B or lens.shape != (B,):
        raise ValueError(f"paged decode attention: {B} queries, block tables {tuple(tables.shape)}, "
                         f"seq lens {tuple(lens.shape)}")
    out = torch.empty_like(q)
    if B == 0:
        return out
    rc = lib.disagg_paged_decode_attention(
        q.data_ptr(), kv_cache.data_ptr(), tables.data_ptr(), tables.shape[1], lens.data_ptr(), B, n_kv,
        n_heads // n_kv, hd, block_size, kv_cache.stride(0), layer_idx * kv_cache.stride(1), kv_cache.stride(2),
        scale, out.data_ptr())
    if rc == 2:
        raise ValueError(f"paged decode attention: a sequence length outside 1..{tables.shape[1] * block_size} "
                         f"(block tables of {tables.shape[1]} blocks of {block_size}): {lens.tolist()}")
    if rc:
        raise RuntimeError(f"paged decode attention failed (code {rc}: 1 unsupported shape, 3 out of memory)")
    return out


def supports_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether prefill_attention (and paged_prefill_attention, with k and v the cache's shape of a row) can
    serve these (T, heads, head_dim) views: float32 on CPU, each token's heads contiguous, a head_dim and query
    group the kernel handles (else torch's SDPA does)."""
    if not _cpu_f32(q, k, v) or not all(_heads_contiguous(t) for t in (q, k, v)) or k.shape != v.shape \
            or q.shape[1] % k.shape[1]:
        return False
    return bool(load().disagg_prefill_attention_limits(q.shape[1] // k.shape[1], q.shape[2]))


def _check_chunks(q: torch.Tensor, out: torch.Tensor, starts: list[int], lens: list[int]) -> None:
    T = q.shape[0]
    if out.shape != q.shape or not out.is_contiguous() or out.dtype != q.dtype:
        raise ValueError(f"prefill attention: out {tuple(out.shape)} must be contiguous {tuple(q.shape)}")
    if len(starts) != len(lens) or any(s < 0 or n < 0 or s + n > T for s, n in zip(starts, lens)):
        raise ValueError(f"prefill attention: sequences (starts {starts[:8]}, lens {lens[:8]}) outside {T} tokens")


def _raise_for(rc: int) -> None:
    if rc:
        raise RuntimeError(f"prefill attention failed (code {rc}: 1 unsupported shape, 2 a chunk past its block "
                           f"table, 3 out of memory)")


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, starts: list[int], lens: list[int],
                      scale: float, out: torch.Tensor) -> None:
    """Causal attention of prompt chunks with nothing cached before them, all in one call: sequence i is
    tokens starts[i] .. starts[i] + lens[i] - 1 of q (T, n_heads, head_dim) and k, v (T, n_kv, head_dim);
    its rows of out (T, n_heads, head_dim, contiguous) are written. Call supports_prefill() first."""
    _check_chunks(q, out, starts, lens)
    if not starts:
        return
    st, ln = torch.tensor(starts, dtype=torch.int64), torch.tensor(lens, dtype=torch.int64)
    _raise_for(load().disagg_prefill_attention(
        q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), st.data_ptr(),
        ln.data_ptr(), len(starts), k.shape[1], q.shape[1] // k.shape[1], q.shape[2], scale, out.data_ptr()))


def paged_prefill_attention(q: torch.Tensor, kv_cache: torch.Tensor, layer_idx: int, block_tables: torch.Tensor,
                            starts: list[int], lens: list[int], ctx_lens: list[int], scale: float,
                            out: torch.Tensor) -> None:
    """Causal attention of prompt chunks that continue a cached prefix (a prefix-cache hit, a chunked
    prefill's later chunks): chunk i is tokens starts[i] .. starts[i] + lens[i] - 1 of q, at positions
    ctx_lens[i] .. of its sequence, whose keys and values (the prefix's and the chunk's own, written already)
    are read in place from kv_cache (the whole contiguous cache, as paged_decode_attention's) through
    block_tables[i]. Call supports_prefill() first (with k, v of the cache's row shape)."""
    _check_chunks(q, out, starts, lens)
    if not starts:
        return
    n_kv, block_size = kv_cache.shape[4], kv_cache.shape[3]
    tables = block_tables.to(torch.int64).contiguous()
    if tables.dim() != 2 or tables.shape[0] != len(starts) or not kv_cache.is_contiguous():
        raise ValueError(f"paged prefill attention: {len(starts)} chunks, block tables {tuple(tables.shape)}")
    st, ln, cl = (torch.tensor(x, dtype=torch.int64) for x in (starts, lens, ctx_lens))
    _raise_for(load().disagg_paged_prefill_attention(
        q.data_ptr(), q.stride(0), kv_cache.data_ptr(), tables.data_ptr(), tables.shape[1], block_size,
        kv_cache.stride(0), layer_idx * kv_cache.stride(1), kv_cache.stride(2), st.data_ptr(), ln.data_ptr(),
        cl.data_ptr(), len(starts), n_kv, q.shape[1] // n_kv, q.shape[2], scale, out.data_ptr()))
