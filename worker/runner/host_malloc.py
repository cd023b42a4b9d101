"""glibc malloc settings for a CPU inference process.

Each forward pass allocates and frees activation tensors of tens of MB (a 4.8k-token prefill's MLP
output is 30-60 MB). glibc serves blocks that large with fresh mmaps, or trims its heap back to the
system once they are freed, so every step pays page faults and zero-filling again: on the bench model
~35% of the prefill's MLP time. Raising the mmap threshold and the trim threshold keeps freed memory
in the heap for the next step (RSS stays at the peak working set instead of shrinking between steps;
~8% more tokens/s in bench/engine_throughput.py). DISAGG_MALLOC_TUNING=0 leaves glibc's defaults.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import platform

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # <malloc.h>
THRESHOLD_BYTES = 1 << 30
_done = False


def tune_malloc() -> bool:
    """Apply the settings once per process; False where this is not glibc or they are turned off."""
    global _done
    if _done:
        return True
    if os.environ.get("DISAGG_MALLOC_TUNING", "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        ok = libc.mallopt(M_MMAP_THRESHOLD, THRESHOLD_BYTES) == 1 and libc.mallopt(M_TRIM_THRESHOLD, THRESHOLD_BYTES) == 1
    except (OSError, AttributeError) as e:
        logger.info("malloc tuning unavailable: %s", e)
        return False
    if ok:
        logger.info("malloc: blocks up to %d MiB come from the heap and freed memory stays for the next step",
                    THRESHOLD_BYTES >> 20)
    _done = ok
    return ok
