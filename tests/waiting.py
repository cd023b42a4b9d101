"""wait_for: poll until a probe returns something truthy (operator, install and e2e tests)."""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def wait_for(probe: Callable[[], T], timeout: float = 30.0, what: str = "condition", interval: float = 0.02) -> T:
    """Poll probe() every `interval` seconds until it returns something truthy (returned); fail with the last value
    after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = probe()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last value: {last!r}")
