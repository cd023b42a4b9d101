"""The CPU KV cache's pages: lazily mapped, populated just ahead of the blocks the engine has used."""
from __future__ import annotations

import ctypes
import ctypes.util
import gc
import mmap
import time

import pytest
import torch

from disagg.worker.runner.kv_cache_memory import KVPrefaulter, allocate_kv_cache, is_lazy_mapping

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
PAGE = mmap.PAGESIZE


def resident_bytes(t: torch.Tensor, start: int, end: int) -> int:
    """Bytes of t's memory in [start, end) that are in RAM (mincore: the kernel's own page table)."""
    n = (end - start) // PAGE
    vec = ctypes.create_string_buffer(n)
    if _libc.mincore(t.data_ptr() + start, n * PAGE, vec) != 0:
        pytest.skip(f"mincore: {ctypes.get_errno()}")
    return sum(1 for b in vec.raw if b & 1) * PAGE


def wait_for(cond, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


def test_populates_ahead_of_the_highest_block_used_and_no_further():
    blocks, block_bytes = 256, 64 << 10  # 16 MiB cache
    cache = allocate_kv_cache((blocks, block_bytes // 4), torch.float32, "cpu")
    assert is_lazy_mapping(cache) and not is_lazy_mapping(torch.zeros(4))
    assert resident_bytes(cache, 0, blocks * block_bytes) == 0  # nothing committed at allocation
    ahead = 4 << 20
    prefaulter = KVPrefaulter(cache, blocks, ahead_bytes=ahead)
    try:
        assert resident_bytes(cache, 0, ahead) == ahead  # the first stretch, before the first step
        assert resident_bytes(cache, ahead, blocks * block_bytes) == 0
        prefaulter.advance(96)  # blocks 0..95 handed out: populate up to 96 blocks + 4 MiB (huge-page aligned)
        target = 96 * block_bytes + ahead
        assert wait_for(lambda: resident_bytes(cache, 0, target) == target)
        assert resident_bytes(cache, target, blocks * block_bytes) == 0  # the rest stays uncommitted
        cache[0, 0] = 7.0
        prefaulter.advance(blocks)
        assert wait_for(lambda: resident_bytes(cache, 0, blocks * block_bytes) == blocks * block_bytes)
        assert cache[0, 0] == 7.0 and cache[1:].abs().sum() == 0  # populating never changes contents
    finally:
        prefaulter.stop()
    assert not prefaulter._thread.is_alive()


def test_thread_ends_when_the_engine_drops_its_cache_without_shutdown():
    cache = allocate_kv_cache((64, 1024), torch.float32, "cpu")
    prefaulter = KVPrefaulter(cache, 64, ahead_bytes=64 << 10)
    del cache
    gc.collect()
    prefaulter.advance(64)
    assert wait_for(lambda: not prefaulter._thread.is_alive(), timeout=5)
