"""Where the autoscaler's numbers come from: each pod's /metrics scraped directly (the default, no Prometheus
needed) or a Prometheus server's HTTP API. Both yield one `PodSample` (samples.py) per pod; a failed read yields a
sample marked missing (never an exception), so the autoscaling pass holds instead of stopping.

Counters and histograms are kept cumulative, as exported; the policy turns two consecutive samples of a pod into
windowed rates and latencies (samples.histogram_delta, samples.histogram_quantile).
"""
from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor

import httpx
from prometheus_client.parser import text_string_to_metric_families

from disagg.operator.autoscaling.samples import (ENDPOINT_POD_LABEL, HANDOFF_SIGNALS, NUM_REQUESTS_RUNNING,
                                                 VLLM_KV_FETCH_BY_STAGE, VLLM_KV_FETCH_PENDING_STAGES,
                                                 VLLM_PENDING_LOADS, Histogram, PodSample)

logger = logging.getLogger(__name__)

Clock = Callable[[], float]


# ---------------------------------------------------------------- parsing
def _fold(series: Iterable[tuple[str, dict[str, str], float]], histogram_names: set[str]) -> tuple[
        dict[str, float], dict[str, Histogram], str | None, dict[str, dict[str, float]]]:
    """(sample name, labels, value) triples -> scalar values and histograms summed over label sets, and the
    hand-off signals this page measured per endpoint pod (samples.HANDOFF_SIGNALS)."""
    values: dict[str, float] = defaultdict(float)
    per_endpoint: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
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
        elif name in HANDOFF_SIGNALS and ENDPOINT_POD_LABEL in labels:
            per_endpoint[labels[ENDPOINT_POD_LABEL]][name] += value
        elif name == VLLM_KV_FETCH_BY_STAGE:
            if labels.get("stage") in VLLM_KV_FETCH_PENDING_STAGES:
                values[VLLM_PENDING_LOADS] += value
        elif not name.endswith("_created"):
            values[name.removesuffix("_total")] += value
    hists = {n: Histogram(tuple(sorted(b.items())), sums[n], counts[n]) for n, b in buckets.items()}
    return dict(values), hists, role, {pod: dict(v) for pod, v in per_endpoint.items()}


def parse_prometheus_text(text: str, *, pod: str = "", role: str | None = None,
                          timestamp: float = 0.0) -> PodSample:
    """Parse a /metrics exposition. `role` defaults to the metrics' `role` label.
    Raises ValueError on text that is not the Prometheus text format."""
    series, histogram_names = [], set()
    for family in text_string_to_metric_families(text):
        if family.type == "histogram":
            histogram_names.add(family.name)
        series.extend((s.name, s.labels, s.value) for s in family.samples)
    values, hists, label_role, per_endpoint = _fold(series, histogram_names)
    return PodSample(pod, role or label_role or "", timestamp, values, hists, endpoint_signals=per_endpoint)


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
        values, hists, role, per_endpoint = _fold(triples, hist_names)
        ts = scraped_at.get(pod, min(float(s["value"][0]) for s in series))
        samples.append(PodSample(pod, role or "", ts, values, hists, endpoint_signals=per_endpoint))
    return samples
