"""Helpers shared by the serving integration tests and the `disagg up` end-to-end tests."""
from __future__ import annotations

import importlib.util

import httpx

NIXL_MISSING = "the nixl package is not installed"  # skip reason when not nixl_available()


def nixl_available() -> bool:
    return importlib.util.find_spec("nixl") is not None


_ABSENT = object()


def metric(url: str, name: str, default: float | object = _ABSENT) -> float:
    """The first sample of a labelled metric `name` on `url`/metrics; `default` when it has none (a labelled
    counter shows once it was counted), else that fails the test."""
    for line in httpx.get(f"{url}/metrics", timeout=5).text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    if default is not _ABSENT:
        return float(default)
    raise AssertionError(f"{name} not in {url}/metrics")
