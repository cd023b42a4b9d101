"""Allocation of the engine's KV-cache tensor.

On CPU the cache lives in an anonymous mapping advised for transparent huge pages: NIXL/UCX
READs between processes (CMA) ran ~0.6x an in-process copy on 4 KiB pages and 0.8-1.1x on huge
pages on the same machine (bench/kv_transfer.py). On CUDA it is a plain device tensor (VRAM).
"""
from __future__ import annotations

import logging
import mmap
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
    return tensor


def _keep_alive(mapping: mmap.mmap) -> None:
    """Runs when the tensor is collected; the mapping is unmapped once nothing references it."""
    del mapping
