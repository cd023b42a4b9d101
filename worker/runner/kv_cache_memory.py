"""Allocation of the engine's KV-cache tensor, and populating its pages ahead of use.

On CPU the cache lives in an anonymous mapping advised for transparent huge pages: NIXL/UCX
READs between processes (CMA) ran ~0.6x an in-process copy on 4 KiB pages and 0.8-1.1x on huge
pages on the same machine (bench/kv_transfer.py). On CUDA it is a plain device tensor (VRAM).

The mapping is lazy: memory is committed as blocks are first used, not at start. But the first write
to a fresh 2 MiB huge page faulted for 2-6 ms on this machine kind (zeroing plus compaction), inside
the step that wrote it: a new request's prefill, or a decode worker's NIXL READ. KVPrefaulter keeps
the blocks just past the highest one used so far populated (MADV_POPULATE_WRITE, on a thread that
runs only when a core is idle), so steps write to mapped memory while the commitment still follows
use; the block pool hands out never-used blocks in id order (engine/block_pool.py).
"""
from __future__ import annotations

import atexit
import ctypes
import ctypes.util
import logging
import mmap
import os
import threading
import time
import weakref

import torch

logger = logging.getLogger(__name__)


def allocate_kv_cache(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str,
                      hugepages: bool = True) -> torch.Tensor:
    """A zero-filled contiguous tensor; the CPU mapping is released when the tensor is."""
    device = torch.device(device)
    if device.type != "cpu" or not hugepages or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    mapping = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        mapping.madvise(mmap.MADV_HUGEPAGE)
    except OSError as e:  # THP disabled in this kernel: 4 KiB pages still work, just slower to transfer
        logger.info("KV cache: huge pages not available (%s)", e)
    tensor = torch.frombuffer(mapping, dtype=dtype, count=torch.Size(shape).numel()).view(shape)
    weakref.finalize(tensor, _keep_alive, mapping)  # the mapping must outlive every view of it
    _lazy[id(tensor)] = tensor
    return tensor


_lazy: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()  # id -> tensor


def is_lazy_mapping(tensor: torch.Tensor) -> bool:
    """Whether allocate_kv_cache made this tensor as a lazily populated anonymous mapping."""
    return _lazy.get(id(tensor)) is tensor


def _keep_alive(mapping: mmap.mmap) -> None:
    """Runs when the tensor is collected; the mapping is unmapped once nothing references it."""
    del mapping


_running: weakref.WeakSet[KVPrefaulter] = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    """Join the threads before the interpreter finalizes: a daemon thread still waiting then was torn
    down mid-wait and aborted the process ("terminate called without an active exception", ~1 exit in 6)."""
    for prefaulter in list(_running):
        prefaulter.stop()


MADV_POPULATE_WRITE = 23  # Linux 5.14+: fault pages in writable without touching their contents
PREFAULT_CHUNK_BYTES = 2 << 20  # one huge page per call


class KVPrefaulter:
    """Populates the pages of the KV blocks in [highest used, highest used + ahead) on a background
    thread at SCHED_IDLE priority. Populating never changes memory contents, so racing the engine's
    own writes is harmless. advance() is cheap and called by the engine after each schedule."""

    def __init__(self, kv_cache: torch.Tensor, num_blocks: int, ahead_bytes: int = 64 << 20):
        self._cache = weakref.ref(kv_cache)  # not a strong reference: the engine owns the cache
        self._base = kv_cache.data_ptr()
        self._block_bytes = kv_cache.numel() * kv_cache.element_size() // num_blocks
        self._total = self._block_bytes * num_blocks
        self._ahead = ahead_bytes
        self._done = 0  # bytes from the start populated (or passed over) so far
        self._target = min(ahead_bytes, self._total)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        self._libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        self._failed = False
        # the first stretch now, in this thread: at start-up the process is busy end to end (loading,
        # then the first requests), and a thread that runs only on idle cores got through 4 of 64 MiB
        t0 = time.perf_counter()
        while self._done < self._target and self._populate(kv_cache):
            pass
        logger.info("KV cache: first %d MiB populated in %.2f s", self._done >> 20, time.perf_counter() - t0)
        self._thread = threading.Thread(target=self._run, name="kv-prefault", daemon=True)
        self._thread.start()
        _running.add(self)

    @property
    def populated_bytes(self) -> int:
        return self._done

    def advance(self, high_water_blocks: int) -> None:
        """Blocks [0, high_water_blocks) have been handed out at least once."""
        target = min(self._total, high_water_blocks * self._block_bytes + self._ahead)
        if target > self._target:
            self._target = target
            self._wake.set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        _running.discard(self)

    def _run(self) -> None:
        try:  # Linux: the calling thread only; its page faults then run on idle cores only
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        except (AttributeError, OSError) as e:
            logger.debug("KV prefault thread at normal priority: %s", e)
        while not self._stop.is_set():
            self._wake.wait(timeout=1.0)
            self._wake.clear()
            while self._done < self._target and not self._stop.is_set():
                cache = self._cache()  # held during the call: the mapping stays mapped
                if cache is None or not self._populate(cache):
                    return
                del cache
            if self._failed or self._cache() is None:  # the engine is gone without shutdown(): so is this thread
                return

    def _populate(self, cache: torch.Tensor) -> bool:
        """The next chunk up to the target; False once populating is impossible (logged)."""
        if self._failed:
            return False
        n = min(PREFAULT_CHUNK_BYTES, self._target - self._done)
        if self._libc.madvise(self._base + self._done, n, MADV_POPULATE_WRITE) != 0:
            self._failed = True  # an older kernel (before 5.14): blocks fault in as they are first written
            logger.info("KV prefault off: madvise(MADV_POPULATE_WRITE) failed: %s", os.strerror(ctypes.get_errno()))
            return False
        self._done += n
        return True
