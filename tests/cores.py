"""The CPUs the tests may load: this process's affinity, cut to its cgroup's CPU quota. os.cpu_count() counts the
host's CPUs, which a container pinned to a few of them, or given a CPU quota, cannot use - a case sized for 4 cores
would then run starved on 2 instead of skipping."""
from __future__ import annotations

import math
import os
from pathlib import Path


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
