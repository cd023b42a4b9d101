"""What the autoscaler reads from a worker: the metric names (vLLM's where vLLM has the metric), one read of one
pod (`PodSample`), and the arithmetic on cumulative histograms that turns two reads into a window. Pure: no I/O;
the sources (sources.py) produce these, the policy (inputs.py, classify.py, policy.py) consumes them."""
from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

# Names as the workers export them (vLLM's where vLLM has the metric). Counters drop the "_total" suffix here.
from disagg.worker.metric_names import (  # noqa: F401 (the policy modules read them here)
    ITL, KV_CACHE_USAGE, NUM_REQUESTS_RUNNING, NUM_REQUESTS_WAITING, PROMPT_TOKENS, TTFT, VLLM_KV_FETCH_BY_STAGE,
    KV_PENDING_LOADS as PENDING_LOADS, KV_PENDING_SENDS as PENDING_SENDS, NIXL_EXPIRED_REQS as EXPIRED_LEASES,
    NIXL_FAILED_TRANSFERS as FAILED_TRANSFERS, NIXL_XFER_TIME as XFER_TIME,
    NUM_WAITING_PROMPT_TOKENS as WAITING_PROMPT_TOKENS,
)
# The same signals measured where every request passes, for any engine: the router (and a vLLM pod's pd-proxy,
# behind a gateway) exports them per endpoint, labelled with that endpoint's pod (router/handoffs.py). Read into
# the named pod's sample under these names (attribute_handoff_signals).
from disagg.worker.router.metrics import (  # noqa: E402
    ENDPOINT_POD_LABEL, HELD_REQUESTS, KV_PENDING_LOADS as ROUTER_PENDING_LOADS,
    KV_PENDING_SENDS as ROUTER_PENDING_SENDS,
)
HANDOFF_SIGNALS = (ROUTER_PENDING_SENDS, ROUTER_PENDING_LOADS)
# vLLM has no disagg:kv_pending_loads; its decode workers count requests by async KV load stage instead. Those
# not yet loaded (waiting to start + in progress) are the same signal, folded under this name when read.
VLLM_KV_FETCH_PENDING_STAGES = ("waiting_to_start", "in_progress")
VLLM_PENDING_LOADS = VLLM_KV_FETCH_BY_STAGE + '{stage=~"waiting_to_start|in_progress"}'


@dataclass(frozen=True)
class Histogram:
    """A Prometheus histogram, cumulative as exported."""

    buckets: tuple[tuple[float, float], ...]  # (upper bound `le`, cumulative count), ascending, last is +inf
    sum: float  # sum of observations (seconds for latency histograms)
    count: float  # number of observations

    @property
    def mean(self) -> float | None:
        return self.sum / self.count if self.count > 0 else None


@dataclass
class PodSample:
    """One read of one pod's metrics."""

    pod: str  # pod name (or the endpoint, outside Kubernetes)
    role: str  # "prefill" | "decode"
    timestamp: float  # seconds: when the values were read (scraper clock, or Prometheus' scrape time)
    values: dict[str, float] = field(default_factory=dict)  # gauge/counter name -> value, summed over label sets
    histograms: dict[str, Histogram] = field(default_factory=dict)  # name -> cumulative, summed over label sets
    error: str | None = None  # why nothing was read (timeout, refused, HTTP status, parse error)
    # what this page measured about other endpoints: endpoint pod -> HANDOFF_SIGNALS name -> value (a router's)
    endpoint_signals: dict[str, dict[str, float]] = field(default_factory=dict)

    @property
    def missing(self) -> bool:
        return self.error is not None


# ---------------------------------------------------------------- histogram arithmetic
def merge_histograms(hs: Iterable[Histogram]) -> Histogram | None:
    """Sum histograms with the same bucket bounds (pods of one deployment); None for none."""
    hs = list(hs)
    if not hs:
        return None
    counts: dict[float, float] = defaultdict(float)
    for h in hs:
        for le, c in h.buckets:
            counts[le] += c
    return Histogram(tuple(sorted(counts.items())), sum(h.sum for h in hs), sum(h.count for h in hs))


def histogram_delta(cur: Histogram, prev: Histogram | None) -> Histogram | None:
    """Observations between two reads; None on a counter reset (pod restarted) or changed bounds."""
    if prev is None:
        return None
    if cur.count < prev.count or [b for b, _ in cur.buckets] != [b for b, _ in prev.buckets]:
        return None
    buckets = tuple((le, c - p) for (le, c), (_, p) in zip(cur.buckets, prev.buckets))
    return Histogram(buckets, cur.sum - prev.sum, cur.count - prev.count)


def histogram_quantile(q: float, h: Histogram) -> float | None:
    """Prometheus' histogram_quantile: linear interpolation inside the bucket; None without observations.
    A quantile in the +Inf bucket returns the highest finite bound (as Prometheus does)."""
    if h.count <= 0 or not h.buckets:
        return None
    rank = q * h.buckets[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for le, c in h.buckets:
        if c >= rank and c > lower_count:
            if math.isinf(le):
                return lower_bound
            return lower_bound + (le - lower_bound) * (rank - lower_count) / (c - lower_count)
        lower_bound, lower_count = le, c
    return lower_bound


def pod_load(sample: PodSample) -> float:
    """Work a pod would have to finish (or hand over) before it can go: requests running or queued, KV held for
    a reader or awaited from a sender."""
    v = sample.values
    return sum(v.get(n, 0.0) for n in (NUM_REQUESTS_RUNNING, NUM_REQUESTS_WAITING, PENDING_SENDS, PENDING_LOADS,
                                             VLLM_PENDING_LOADS))


def attribute_handoff_signals(samples: list[PodSample]) -> list[PodSample]:
    """Each worker pod's pending sends and loads as the routers (and pd-proxies) measured them, summed over every
    page read, into that pod's sample under the router's names; pods no page named get none (the signal stays
    unavailable rather than read as zero). The pages' own samples (routers) are returned unchanged."""
    named: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for s in samples:
        for pod, values in s.endpoint_signals.items():
            for name, value in values.items():
                named[pod][name] += value
    for s in samples:
        if s.pod in named and not s.missing:
            s.values.update(named[s.pod])
    return samples
