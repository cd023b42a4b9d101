"""Outlier detection: a worker endpoint whose hops fail is ejected - not chosen - for a while, longer each time
it is ejected again; when the time is up it is chosen again once its readiness probe passes. Pure decisions on
a per-endpoint record; the clock is passed in.

A timed-out hop ejects at once: it cost a whole bound's wait, and the next request should not pay it too. Other
failures (refused connection, 5xx, a broken stream) eject after `consecutive_failures` in a row (one already
takes the endpoint out until its next probe passes: endpoints.EndpointPool.mark_failed).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class OutlierPolicy:
    consecutive_failures: int = 2  # failures in a row that eject (a timeout ejects at once)
    base_ejection_s: float = 5.0  # the first ejection; each further one doubles it
    max_ejection_s: float = 300.0

    def problems(self) -> list[str]:
        out = []
        if self.consecutive_failures < 1:
            out.append(f"--eject-after-failures must be >= 1, got {self.consecutive_failures}")
        if not self.base_ejection_s > 0:
            out.append(f"--ejection-seconds must be > 0, got {self.base_ejection_s}")
        if self.max_ejection_s < self.base_ejection_s:
            out.append(f"--max-ejection-seconds ({self.max_ejection_s}) must be >= --ejection-seconds "
                       f"({self.base_ejection_s})")
        return out


@dataclass
class Health:
    """One endpoint's record."""
    failures: int = 0  # hop failures in a row
    ejections: int = 0  # ejections in a row (sets the next ejection's length; reset once it stays healthy)
    ejected_until: float = 0.0  # clock time; not chosen before it
    last_ejection_s: float = 0.0


def ejection_seconds(policy: OutlierPolicy, ejections: int) -> float:
    """The length of the `ejections`-th ejection in a row: base, 2 x base, 4 x base, ... up to the max."""
    return min(policy.max_ejection_s, policy.base_ejection_s * 2 ** max(0, ejections - 1))


def on_failure(health: Health, policy: OutlierPolicy, now: float, timed_out: bool) -> float | None:
    """Record a failed hop; the ejection's length when this failure ejects the endpoint, else None."""
    health.failures += 1
    if is_ejected(health, now) or (not timed_out and health.failures < policy.consecutive_failures):
        return None
    health.ejections += 1
    health.last_ejection_s = ejection_seconds(policy, health.ejections)
    health.ejected_until = now + health.last_ejection_s
    health.failures = 0
    return health.last_ejection_s


def on_success(health: Health, now: float) -> None:
    """A hop answered: failures in a row end; once it stayed healthy as long as its last ejection lasted, a
    new ejection starts from the base length again."""
    health.failures = 0
    if health.ejections and now >= health.ejected_until + health.last_ejection_s:
        health.ejections = 0


def is_ejected(health: Health, now: float) -> bool:
    return now < health.ejected_until
