"""The CPUs this process may use, and how many threads the engine's CPU kernels get.

os.cpu_count() counts the host's CPUs, which a container pinned to a few of them, or given a CPU quota, cannot
use. torch's CPU kernels (OpenMP) start one thread per CPU of the process's affinity by default, whatever the
quota: a pod limited to 1 CPU on a 64-core node runs 64 threads, and two workers on one machine each run a thread
per core - every OpenMP barrier then waits for a descheduled peer. Measured with `disagg up` on 2 cores (1 prefill
+ 1 decode, bench/overload.py's load at 68 req/s): 2 threads per worker served 26 req/s within the SLO, 1 thread
each 38 (engine CPU per request: prefill 23 -> 17 ms, decode 35 -> 19 ms).
"""
from __future__ import annotations

import logging
import math
import os
from pathlib import Path

logger = logging.getLogger(__name__)


def cgroup_cpu_quota(root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """CPUs' worth of time the cgroup may use (quota / period), or None when unlimited or unknown."""
    try:  # cgroup v2
        quota, period = (root / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:  # cgroup v1
        quota = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period = int((root / "cpu" / "cpu.cfs_period_us").read_text())
        return None if quota <= 0 else quota / period
    except (OSError, ValueError):
        return None


def usable_cores() -> list[int]:
    """The CPU ids this process may run on, as many as the quota allows (at least one)."""
    cores = sorted(os.sched_getaffinity(0))
    quota = cgroup_cpu_quota()
    return cores if quota is None else cores[:max(1, math.floor(quota))]


def cpu_threads(requested: int | None, environ: dict[str, str] | os._Environ = os.environ) -> tuple[int, str]:
    """(threads, where the number came from): `requested` when > 0, else $OMP_NUM_THREADS when set, else the
    usable cores (the quota counted)."""
    if requested:
        return requested, "--cpu-threads"
    try:
        from_env = int(environ.get("OMP_NUM_THREADS", ""))
    except ValueError:
        from_env = 0
    if from_env > 0:
        return from_env, "OMP_NUM_THREADS"
    return len(usable_cores()), "the usable cores"


def set_cpu_threads(requested: int | None) -> int:
    """Size torch's intra-op pool (before any kernel runs) and say so."""
    import torch

    threads, source = cpu_threads(requested)
    torch.set_num_threads(threads)
    logger.info("CPU kernels: %d thread(s) (%s)", threads, source)
    return threads
