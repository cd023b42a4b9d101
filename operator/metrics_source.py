"""Where the autoscaler's numbers come from: each pod's /metrics scraped directly (the default, no Prometheus
needed) or a Prometheus server's HTTP API. Both yield one `PodSample` per pod; a failed read yields a sample
marked missing (never an exception), so the autoscale loop holds instead of stopping.

Counters and histograms are kept cumulative, as exported; the policy turns two consecutive samples of a pod into
windowed rates and latencies (`histogram_delta`, `histogram_quantile`).
"""
from __future__ import annotations

import logging
import math
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

logger = logging.getLogger(__name__)

# Names as the workers export them (vLLM's where vLLM has the metric). Counters drop the "_total" suffix here.
NUM_REQUESTS_WAITING = "vllm:num_requests_waiting"
NUM_REQUESTS_RUNNING = "vllm:num_requests_running"
KV_CACHE_USAGE = "vllm:kv_cache_usage_perc"  # fraction 0..1, as in vLLM
TTFT = "vllm:time_to_first_token_seconds"  # histogram
ITL = "vllm:inter_token_latency_seconds"  # histogram
XFER_TIME = "vllm:nixl_xfer_time_seconds"  # histogram
FAILED_TRANSFERS = "vllm:nixl_num_failed_transfers"  # counter
EXPIRED_LEASES = "vllm:nixl_num_kv_expired_reqs"  # counter
PENDING_SENDS = "disagg:kv_pending_sends"  # gauge, prefill: requests whose KV waits to be pulled
PENDING_LOADS = "disagg:kv_pending_loads"  # gauge, decode: requests waiting for remote KV
WAITING_PROMPT_TOKENS = "disagg:num_waiting_prompt_tokens"  # gauge, prompt tokens of waiting requests

Clock = Callable[[], float]


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


# ---------------------------------------------------------------- parsing
def _fold(series: Iterable[tuple[str, dict[str, str], float]], histogram_names: set[str]) -> tuple[
        dict[str, float], dict[str, Histogram], str | None]:
    """(sample name, labels, value) triples -> scalar values and histograms summed over label sets."""
    values: dict[str, float] = defaultdict(float)
    buckets: dict[str, dict[float, float]] = defaultdict(lambda: defaultdict(float))
    sums: dict[str, float] = defaultdict(float)
    counts: dict[str, float] = defaultdict(float)
    role = None
    for name, labels, value in series:
        role = role or labels.get("role")
        base, _, suffix = name.rpartition("_")
        if base in histogram_names and suffix in ("bucket", "sum", "count"):
            if suffix == "bucket":
                buckets[base][float(labels["le"])] += value
            elif suffix == "sum":
                sums[base] += value
            else:
                counts[base] += value
        elif not name.endswith("_created"):
            values[name.removesuffix("_total")] += value
    hists = {n: Histogram(tuple(sorted(b.items())), sums[n], counts[n]) for n, b in buckets.items()}
    return dict(values), hists, role


def parse_prometheus_text(text: str, *, pod: str = "", role: str | None = None,
                          timestamp: float = 0.0) -> PodSample:
    """Parse a /metrics exposition. `role` defaults to the metrics' `role` label.
    Raises ValueError on text that is not the Prometheus text format."""
    series, histogram_names = [], set()
    for family in text_string_to_metric_families(text):
        if family.type == "histogram":
            histogram_names.add(family.name)
        series.extend((s.name, s.labels, s.value) for s in family.samples)
    values, hists, label_role = _fold(series, histogram_names)
    return PodSample(pod, role or label_role or "", timestamp, values, hists)


# ---------------------------------------------------------------- direct scrape (default)
def scrape_pod(url: str, *, pod: str, role: str, timeout: float, clock: Clock = time.time,
               client: httpx.Client | None = None) -> PodSample:
    """GET `url` (a pod's http://ip:port/metrics). Never raises: failures come back as a missing sample."""
    try:
        if client is not None:
            resp = client.get(url, timeout=timeout)
        else:
            resp = httpx.get(url, timeout=timeout)
        resp.raise_for_status()
        return parse_prometheus_text(resp.text, pod=pod, role=role, timestamp=clock())
    except (httpx.HTTPError, ValueError, KeyError) as e:
        logger.warning("scrape %s (%s) failed: %s", url, pod, e)
        return PodSample(pod, role, clock(), error=f"{type(e).__name__}: {e}")


MAX_SCRAPE_THREADS = 16


def scrape_pods(targets: list[tuple[str, str, str]], timeout: float, clock: Clock = time.time) -> list[PodSample]:
    """(url, pod, role) each -> one sample each, in order; concurrently, over one connection pool."""
    if not targets:
        return []
    with httpx.Client() as client, ThreadPoolExecutor(min(MAX_SCRAPE_THREADS, len(targets))) as pool:
        return list(pool.map(lambda t: scrape_pod(t[0], pod=t[1], role=t[2], timeout=timeout, clock=clock,
                                                  client=client), targets))


def pod_load(sample: PodSample) -> float:
    """Work a pod would have to finish (or hand over) before it can go: requests running or queued, KV held for
    a reader or awaited from a sender."""
    v = sample.values
    return sum(v.get(n, 0.0) for n in (NUM_REQUESTS_RUNNING, NUM_REQUESTS_WAITING, PENDING_SENDS, PENDING_LOADS))


# ---------------------------------------------------------------- Prometheus HTTP API
class PrometheusSource:
    """Instant queries against /api/v1/query. Series are grouped by the `pod` label; the sample timestamp is the
    pod's last scrape time (`timestamp(...)`), so a pod Prometheus stopped scraping shows up stale."""

    def __init__(self, url: str, *, timeout: float = 5.0, selector: str = "", pod_label: str = "pod",
                 client: httpx.Client | None = None):
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.selector = selector  # extra label matchers, e.g. 'namespace="ml",app_kubernetes_io_instance="x"'
        self.pod_label = pod_label
        self.client = client

    def _query(self, promql: str) -> list[dict]:
        get = self.client.get if self.client is not None else httpx.get
        resp = get(f"{self.url}/api/v1/query", params={"query": promql}, timeout=self.timeout)
        resp.raise_for_status()
        body = resp.json()
        if body.get("status") != "success" or body.get("data", {}).get("resultType") != "vector":
            raise ValueError(f"Prometheus query {promql!r}: expected a success vector, got {str(body)[:200]}")
        return body["data"]["result"]

    def fetch(self, roles: Iterable[str] = ("prefill", "decode")) -> list[PodSample] | str:
        """One sample per pod; on a failed query, the error text (the caller marks every pod missing)."""
        match = f'__name__=~"(vllm|disagg):.+",role=~"{"|".join(roles)}"'
        selector = "{" + match + (f",{self.selector}" if self.selector else "") + "}"
        try:
            series = self._query(selector)
            stamps = self._query(f"timestamp({selector.replace('(vllm|disagg):.+', NUM_REQUESTS_RUNNING)})")
        except (httpx.HTTPError, ValueError, KeyError) as e:
            logger.warning("Prometheus %s query failed: %s", self.url, e)
            return f"{type(e).__name__}: {e}"
        return samples_from_prometheus(series, stamps, self.pod_label)


def samples_from_prometheus(series: list[dict], stamps: list[dict], pod_label: str = "pod") -> list[PodSample]:
    """Group /api/v1/query vector results into PodSamples (pure; see PrometheusSource)."""
    by_pod: dict[str, list[tuple[str, dict[str, str], float]]] = defaultdict(list)
    for s in series:
        labels = dict(s["metric"])
        by_pod[labels.get(pod_label, "")].append((labels.pop("__name__"), labels, float(s["value"][1])))
    scraped_at = {s["metric"].get(pod_label, ""): float(s["value"][1]) for s in stamps}
    samples = []
    for pod, triples in sorted(by_pod.items()):
        hist_names = {n.removesuffix("_bucket") for n, labels, _ in triples if n.endswith("_bucket") and "le" in labels}
        values, hists, role = _fold(triples, hist_names)
        ts = scraped_at.get(pod, min(float(s["value"][0]) for s in series))
        samples.append(PodSample(pod, role or "", ts, values, hists))
    return samples
