"""Worker endpoints the router can send to, and the choice among them (pure; no I/O here): which are candidates
(ready, not ejected, of the paired revision) is decided here for every policy; their order is the policy's."""
from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from typing import Any
from dataclasses import dataclass, field

from disagg.worker.metric_names import KV_CACHE_USAGE, NUM_REQUESTS_RUNNING, NUM_REQUESTS_WAITING
from disagg.worker.router import outliers
from disagg.worker.router.policies import DEFAULT_POLICY, make_policy
from disagg.worker.router.policy import Candidate, RoutingPolicy


# a busy worker may answer a probe late: only probes left unanswered (timed out, in a row) for this long take it
# out and abandon the waits on it (an answer other than 200, or a refused connection, takes it out at once).
# Per router: `--unresponsive-after`, spec.router.timeouts.unresponsiveSeconds (a CPU-starved vLLM needs more)
UNRESPONSIVE_AFTER_S = 8.0
# what an endpoint held at its last 429 is its capacity at the router's door (capacity.py) exactly for this long,
# then grows by a tenth each such period (a flood let through to find it again would spend prefills on requests
# then refused), and is forgotten this long after the 429
CAPACITY_EXACT_S = 5.0
CAPACITY_FORGET_S = 60.0
# what a worker's /metrics says about its load: the same names on both engines (ours exports vLLM's)
RUNNING, WAITING, KV_USAGE = NUM_REQUESTS_RUNNING, NUM_REQUESTS_WAITING, KV_CACHE_USAGE


@dataclass
class Endpoint:
    url: str  # base URL, e.g. http://10.0.0.5:8000
    ready: bool = False  # last readiness probe answered 200
    outstanding: int = 0  # requests this router has in flight there
    revision: str | None = None  # serving revision (pod label); prefill and decode are paired by it
    name: str | None = None  # its pod's name (discovery), for per-endpoint metrics; None: host:port
    ready_path: str | None = None  # /ready, or /health for a worker without /ready (vLLM); None: not known yet
    reported_load: float = 0.0  # running + waiting requests by its last /metrics (every router's requests)
    kv_usage: float = 0.0  # KV cache usage, 0..1, by its last /metrics
    probe_timeouts: int = 0  # readiness probes in a row that timed out
    unanswered_since: float | None = None  # when the first of those was sent (monotonic); None: the last answered
    refused_at: float | None = None  # when its last probe failed without a timeout (refused, reset); None: it answered
    unresponsive_after_s: float = UNRESPONSIVE_AFTER_S  # 0: never judged by its probes (the hop bounds still hold)
    health: outliers.Health = field(default_factory=outliers.Health)  # hop failures and ejection (outliers.py)
    # it answered 429 (its waiting queue is full): not picked before this (monotonic) while another can take the
    # request - except for `credits` requests, one per request of this router that finished there meanwhile
    saturated_until: float = 0.0
    credits: int = 0
    # how many of this router's requests it held when it last answered 429 (in flight there, the refused one
    # not counted), and when (monotonic): its capacity as this router sees it (door_capacity)
    capacity_seen: int = 0
    capacity_since: float = 0.0
    waiting_probe: Any = field(default=None, repr=False, compare=False)  # probes.await_ready's task, shared
    # taken out by a hop that failed fast (a 5xx, a reset; not a timeout) and not probed since: with no endpoint
    # of its pool ready it is chosen anyway (EndpointPool.available), rather than every request refused until a
    # probe answers - which a busy worker's may not do for seconds
    failed_fast: bool = False

    def unresponsive(self) -> bool:
        """Its readiness probes have timed out for unresponsive_after_s and no hop got an answer from it
        meanwhile (a hung process, a partition) - unlike a draining worker, which answers them with 503, or a busy
        one, which answers late but answers."""
        return (self.unresponsive_after_s > 0 and self.unanswered_since is not None
                and time.monotonic() - self.unanswered_since >= self.unresponsive_after_s)

    def probe_timed_out(self, sent_at: float) -> None:
        self.probe_timeouts += 1
        if self.unanswered_since is None:
            self.unanswered_since = sent_at

    def probe_answered(self) -> None:
        self.probe_timeouts, self.unanswered_since = 0, None

    def answered(self) -> None:
        """It answered a hop (a status, a streamed chunk): alive, whatever its late probes say. A worker whose
        event loop is flooded answers /ready late but is no hung process; judged by its probes alone, overload
        would eject it."""
        self.unanswered_since = None

    def door_capacity(self, now: float) -> int | None:
        """What it may hold of this router's requests (the door, capacity.py): what it held at its last 429, for
        CAPACITY_EXACT_S; then a tenth more (at least one) each such period - room that grew is found a few
        requests at a time, and a 429 sets it again - and nothing known CAPACITY_FORGET_S after that 429 (None)."""
        age = now - self.capacity_since
        if not self.capacity_seen or age >= CAPACITY_FORGET_S:
            return None
        capacity = self.capacity_seen
        for _ in range(int(age // CAPACITY_EXACT_S)):
            capacity += max(capacity // 10, 1)
        return capacity

    def saturated(self, now: float) -> bool:
        """Full by its last 429, with no room freed since (capacity.py)."""
        return now < self.saturated_until and self.credits <= 0

    def load(self) -> float:
        """This router's in-flight requests are counted at once, the worker's own count (which also holds other
        routers' requests) as of its last scrape: the larger of the two."""
        return max(float(self.outstanding), self.reported_load)

    def candidate(self) -> Candidate:
        """What a policy weighs of it (its cached prefix is the prefix-aware plan's: prefix_router.py)."""
        return Candidate(self.url, load=self.load(), kv_usage=self.kv_usage, revision=self.revision)


def load_from_metrics(text: str) -> tuple[float, float] | None:
    """(running + waiting requests, KV cache usage) from a Prometheus text page, summed over label sets;
    None when the page has none of them. A line scan: the router reads this every probe interval."""
    sums = {RUNNING: 0.0, WAITING: 0.0, KV_USAGE: 0.0}
    seen = False
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        name, _, rest = line.partition("{") if "{" in line.split(" ", 1)[0] else line.partition(" ")
        if name not in sums:
            continue
        try:
            sums[name] += float(rest.rsplit("}", 1)[-1].split()[0])
        except (ValueError, IndexError):
            continue
        seen = True
    return (sums[RUNNING] + sums[WAITING], sums[KV_USAGE]) if seen else None


@dataclass
class EndpointPool:
    """One role's endpoints. `pick` takes the first of the routing policy's order (policy.py: least-loaded weighs
    requests in flight from here or reported by the worker's metrics, then KV cache usage; round-robin rotates;
    ties rotate so load spreads evenly). Ejected endpoints (outliers.py) are left out while any other ready one
    is left (an ejection never empties a pool whose probes pass)."""

    role: str  # prefill | decode
    policy: RoutingPolicy | str = DEFAULT_POLICY  # a RoutingPolicy, or its name (policies.py); one for both pools
    endpoints: dict[str, Endpoint] = field(default_factory=dict)  # url -> endpoint
    _turn: itertools.count = field(default_factory=itertools.count)
    # requests past the router's door bound for this pool that are not at one of its endpoints yet (their
    # prefill hop runs): counted against the pool's capacity at the door (door_full)
    pending: int = 0
    outlier_policy: outliers.OutlierPolicy = field(default_factory=outliers.OutlierPolicy)
    clock: Callable[[], float] = time.monotonic
    unresponsive_after_s: float = UNRESPONSIVE_AFTER_S  # given to each endpoint (Endpoint.unresponsive)
    # whether a failed hop takes the endpoint out (mark_failed). False for a decode side's own engine (pd-proxy's
    # vLLM): it is the only place its requests can go, so taking it out would only refuse the next ones (a 503
    # until a probe answers, which a busy engine may not do for seconds); its probes alone judge it
    judged_by_hops: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.policy, str):
            self.policy = make_policy(self.policy)

    def set_urls(self, urls: list[str], revisions: dict[str, str | None] | None = None,
                 names: dict[str, str] | None = None) -> None:
        """Replace the membership (discovery); known endpoints keep their state.
        revisions: url -> serving revision, and names: url -> pod name, when discovery knows them."""
        revisions = {u.rstrip("/"): r for u, r in (revisions or {}).items()}
        names = {u.rstrip("/"): n for u, n in (names or {}).items()}
        urls = [u.rstrip("/") for u in urls]
        self.endpoints = {u: self.endpoints.get(u) or Endpoint(u) for u in urls}
        for url, endpoint in self.endpoints.items():
            endpoint.revision = revisions.get(url)
            endpoint.name = names.get(url)
            endpoint.unresponsive_after_s = self.unresponsive_after_s

    @property
    def scrapes_metrics(self) -> bool:
        """Least-loaded and prefix-aware weigh each worker's own /metrics (running + waiting, KV usage), which
        the probes scrape; round-robin weighs nothing."""
        return self.policy.weighs_load

    def available(self, exclude: set[str] = frozenset()) -> list[Endpoint]:
        """The ready endpoints but `exclude`, those not ejected when there are any. With none ready: those taken
        out by a hop that failed fast (Endpoint.failed_fast) whose probes have not timed out for long - as
        Envoy's panic threshold routes to every host when too few are healthy: one 5xx, or a reset connection,
        at the only decode worker must not refuse every request until its next probe passes."""
        ready = [e for e in self.endpoints.values() if e.ready and e.url not in exclude]
        if not ready:
            return [e for e in self.endpoints.values() if e.failed_fast and e.url not in exclude
                    and not e.unresponsive()]
        now = self.clock()
        return [e for e in ready if not outliers.is_ejected(e.health, now)] or ready

    def ejected(self) -> list[Endpoint]:
        now = self.clock()
        return [e for e in self.endpoints.values() if outliers.is_ejected(e.health, now)]

    def ready_revisions(self) -> set[str | None]:
        return {e.revision for e in self.endpoints.values() if e.ready}

    def ranked(self, exclude: set[str] = frozenset(), revisions: set[str | None] | None = None,
               costs: dict[str, float] | None = None) -> list[Endpoint]:
        """The available endpoints in the order to try them for this pick; each call is one turn of the pool.
        revisions: only endpoints of these serving revisions when any is available (during a rollout, KV moves
        only between prefill and decode pods that run the same model/config).
        costs: url -> this request's cost there (the policy's plan: prefix_policy.py); the cheapest goes first."""
        now = self.clock()
        candidates = [e for e in self.available(exclude) if not e.saturated(now)]
        if revisions is not None:
            candidates = [e for e in candidates if e.revision in revisions] or candidates
        if not candidates:
            return []
        by_url = {e.url: e for e in candidates}
        order = self.policy.rank([e.candidate() for e in candidates], next(self._turn), costs)
        return [by_url[c.url] for c in order]

    def pick(self, exclude: set[str] = frozenset(), revisions: set[str | None] | None = None,
             costs: dict[str, float] | None = None) -> Endpoint | None:
        """The first of `ranked`; None when no endpoint is available (or every one is saturated). A saturated
        endpoint taken on a credit spends it."""
        chosen = next(iter(self.ranked(exclude, revisions, costs)), None)
        if chosen is not None and self.clock() < chosen.saturated_until:
            chosen.credits -= 1
        return chosen

    def unpick(self, endpoint: Endpoint) -> None:
        """A pick that is not sent after all: the credit it spent comes back."""
        if self.clock() < endpoint.saturated_until:
            endpoint.credits += 1

    def saturated_only(self, exclude: set[str] = frozenset()) -> bool:
        """Endpoints are available, and every one is saturated: the request waits for room or is shed."""
        now = self.clock()
        available = self.available(exclude)
        return bool(available) and all(e.saturated(now) for e in available)

    def saturation_ends_in(self, exclude: set[str] = frozenset()) -> float:
        """Seconds until the first available endpoint's saturation runs out (0 when one is not saturated)."""
        now = self.clock()
        return max(min((e.saturated_until for e in self.available(exclude)), default=now) - now, 0.0)

    def mark_saturated(self, endpoint: Endpoint, seconds: float, refused_counted: bool = True) -> None:
        """It answered 429 with Retry-After `seconds`: full until then (no room freed since it said so), and
        what this router has in flight there is its capacity (Endpoint.door_capacity; `refused_counted`: the
        refused request is in `outstanding` still). Not a failure: its health and ejection are left alone."""
        now = self.clock()
        endpoint.saturated_until = max(endpoint.saturated_until, now + seconds)
        endpoint.credits = 0
        endpoint.capacity_seen = max(endpoint.outstanding - refused_counted, 1)
        endpoint.capacity_since = now

    def _door_capacities(self) -> list[int] | None:
        now = self.clock()
        available = self.available()
        capacities = [e.door_capacity(now) for e in available]
        return capacities if available and None not in capacities else None

    def door_limited(self) -> bool:
        """Every available endpoint's capacity is known (a 429 told it): the door counts."""
        return self._door_capacities() is not None

    def door_full(self, committed: int = 0) -> bool:
        """The requests this router has in flight for the pool - at its endpoints, in their prefill hop
        (`pending`), waiting for room with their first token sent (`committed`) - fill what the endpoints held
        when each last answered 429: a new request would only queue behind them (or be refused after its
        prefill was spent), so it waits at the door or is shed there. Unknown capacity (no recent 429 from an
        endpoint): never full."""
        capacities = self._door_capacities()
        if capacities is None:
            return False
        in_flight = self.pending + committed + sum(e.outstanding for e in self.endpoints.values())
        return in_flight >= sum(capacities)

    def released(self, endpoint: Endpoint, freed: bool = True) -> bool:
        """A request this router sent there finished; True when that freed room at a saturated endpoint (one
        request's worth: its queue moved by one). freed False: it was refused there (429), and freed nothing."""
        endpoint.outstanding -= 1
        if freed and self.clock() < endpoint.saturated_until:
            endpoint.credits += 1
            return True
        return False

    def mark_failed(self, endpoint: Endpoint, timed_out: bool = False) -> float | None:
        """A connection error, 5xx or timeout: stop choosing it until the next probe says it is ready, and
        eject it when outlier detection says so. Returns the ejection's length when it was ejected now."""
        if not self.judged_by_hops:
            return None
        endpoint.failed_fast = (endpoint.ready or endpoint.failed_fast) and not timed_out
        endpoint.ready = False
        return outliers.on_failure(endpoint.health, self.outlier_policy, self.clock(), timed_out)

    def mark_ok(self, endpoint: Endpoint) -> None:
        outliers.on_success(endpoint.health, self.clock())
