"""Worker endpoints the router can send to, and the choice among them (pure; no I/O here)."""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field


@dataclass
class Endpoint:
    url: str  # base URL, e.g. http://10.0.0.5:8000
    ready: bool = False  # last /ready probe answered 200
    outstanding: int = 0  # requests this router has in flight there
    revision: str | None = None  # serving revision (pod label); prefill and decode are paired by it


@dataclass
class EndpointPool:
    """One role's endpoints. `pick` prefers ready endpoints with the fewest outstanding requests
    (policy least-loaded) or rotates (round-robin); ties rotate so load spreads evenly."""

    role: str  # prefill | decode
    policy: str = "least-loaded"  # least-loaded | round-robin
    endpoints: dict[str, Endpoint] = field(default_factory=dict)  # url -> endpoint
    _turn: itertools.count = field(default_factory=itertools.count)

    def set_urls(self, urls: list[str], revisions: dict[str, str | None] | None = None) -> None:
        """Replace the membership (discovery); known endpoints keep their state.
        revisions: url -> serving revision, when discovery knows it."""
        revisions = {u.rstrip("/"): r for u, r in (revisions or {}).items()}
        urls = [u.rstrip("/") for u in urls]
        self.endpoints = {u: self.endpoints.get(u) or Endpoint(u) for u in urls}
        for url, endpoint in self.endpoints.items():
            endpoint.revision = revisions.get(url)

    def available(self, exclude: set[str] = frozenset()) -> list[Endpoint]:
        return [e for e in self.endpoints.values() if e.ready and e.url not in exclude]

    def ready_revisions(self) -> set[str | None]:
        return {e.revision for e in self.endpoints.values() if e.ready}

    def pick(self, exclude: set[str] = frozenset(), revisions: set[str | None] | None = None) -> Endpoint | None:
        """revisions: prefer endpoints of these serving revisions when any is available (during a
        rollout, KV moves only between prefill and decode pods that run the same model/config)."""
        candidates = self.available(exclude)
        if revisions is not None:
            candidates = [e for e in candidates if e.revision in revisions] or candidates
        if not candidates:
            return None
        turn = next(self._turn)
        if self.policy == "round-robin":
            return candidates[turn % len(candidates)]
        fewest = min(e.outstanding for e in candidates)
        best = [e for e in candidates if e.outstanding == fewest]
        return best[turn % len(best)]

    def mark_failed(self, endpoint: Endpoint) -> None:
        """A connection error or 5xx: stop choosing it until the next probe says it is ready."""
        endpoint.ready = False
