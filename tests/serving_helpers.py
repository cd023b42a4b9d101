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


def metric_sum(url: str, name: str, default: float | object = _ABSENT, timeout: float = 10.0) -> float:
    """The sum of a metric's samples over every label set on `url`/metrics (`name` may end with its own
    `{labels}` prefix); `default` when it has none, else that fails the test."""
    total, found = 0.0, False
    for line in httpx.get(f"{url}/metrics", timeout=timeout).text.splitlines():
        if line.startswith(name + ("" if name.endswith("}") else "{")) or line.startswith(name + " "):
            total, found = total + float(line.rsplit(" ", 1)[1]), True
    if not found and default is not _ABSENT:
        return float(default)
    assert found, f"{name} not in {url}/metrics"
    return total
