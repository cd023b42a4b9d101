"""Prometheus metrics of a worker, on its own CollectorRegistry (no global state): the engine's and the request
latencies declared here, the KV connectors' as they declare them (KVConnectorBase.metrics).

Names (metric_names.py), types and meanings follow vLLM where vLLM has the metric (dashboards, KEDA triggers and
routers work unchanged); the rest carries the `disagg:` prefix. Every metric has `model_name` and `role` labels.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST  # noqa: F401  (re-exported for the HTTP layers)

from disagg.worker import metric_names as names
from disagg.worker.engine.stats import EngineSnapshot
from disagg.worker.kv_transfer.base import ConnectorMetric
from disagg.worker.kv_transfer.factory import exported_connector_metrics

LABELS = ("model_name", "role")
# why a request was refused before the engine (server/admission.py, body_limit.py)
REJECT_REASONS = ("waiting_requests", "waiting_prompt_tokens", "body_too_large", "body_timeout", "prompt_too_long")

# seconds; vLLM's buckets for request latencies
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)


class ConnectorMetrics:
    """The connectors' declared metrics (kv_transfer/base.ConnectorMetric), registered once per name and fed from
    each step's connector stats."""

    def __init__(self, declared: Sequence[ConnectorMetric], registry: CollectorRegistry, labels: tuple[str, str]):
        kinds = {"counter": Counter, "gauge": Gauge, "histogram": Histogram}
        first: dict[str, ConnectorMetric] = {}
        metrics: dict[str, Any] = {}
        self._feeds: list[tuple[str, str, Any]] = []  # (stats key, kind, labelled metric)
        for m in dict.fromkeys(declared):
            seen = first.setdefault(m.name, m)
            if (seen.kind, seen.documentation, seen.buckets) != (m.kind, m.documentation, m.buckets):
                raise ValueError(f"connector metric {m.name} is declared twice with different kind, documentation "
                                 f"or buckets: {seen} and {m}")
            if m.kind not in kinds:
                raise ValueError(f"connector metric {m.name}: kind {m.kind!r} is not one of {', '.join(kinds)}")
            if m.name not in metrics:
                extra = {"buckets": m.buckets} if m.kind == "histogram" and m.buckets else {}
                metrics[m.name] = kinds[m.kind](m.name, m.documentation, LABELS, registry=registry,
                                                **extra).labels(*labels)
            self._feeds.append((m.stats_key, m.kind, metrics[m.name]))

    def observe(self, stats: dict[str, Any]) -> None:
        for key, kind, metric in self._feeds:
            value = stats.get(key)
            if value is None:
                continue
            values = value if isinstance(value, (list, tuple)) else (value,)
            if kind == "histogram":
                for v in values:
                    metric.observe(v)
            elif kind == "counter":
                if any(values):
                    metric.inc(sum(values))
            elif values:
                metric.set(values[-1])


class WorkerMetrics:
    def __init__(self, model_name: str, role: str, connector_metrics: Sequence[ConnectorMetric] | None = None):
        """connector_metrics: what the KV connectors declare (kv_transfer/factory.exported_connector_metrics; by
        default the built-in connectors')."""
        self.registry = CollectorRegistry()
        r, labels = self.registry, (model_name, role)

        def gauge(name: str, doc: str) -> Any:
            return Gauge(name, doc, LABELS, registry=r).labels(*labels)

        def counter(name: str, doc: str) -> Any:
            return Counter(name, doc, LABELS, registry=r).labels(*labels)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(name, doc, LABELS, buckets=buckets, registry=r).labels(*labels)

        self.num_requests_running = gauge(names.NUM_REQUESTS_RUNNING, "Requests in model execution batches.")
        self.num_requests_waiting = gauge(names.NUM_REQUESTS_WAITING, "Requests waiting to be processed.")
        self.num_waiting_prompt_tokens = gauge(names.NUM_WAITING_PROMPT_TOKENS, "Prompt tokens of the "
                                               "requests waiting to be processed.")
        self.kv_cache_usage_perc = gauge(names.KV_CACHE_USAGE, "KV-cache usage. 1 means 100 percent usage.")
        self.kv_pending_sends = gauge(names.KV_PENDING_SENDS, "Requests whose KV waits here to be pulled.")
        self.kv_pending_loads = gauge(names.KV_PENDING_LOADS, "Requests waiting here for remote KV.")
        self.num_preemptions = counter(names.NUM_PREEMPTIONS, "Cumulative number of preemptions.")
        self.prompt_tokens = counter(names.PROMPT_TOKENS, "Number of prefill tokens processed.")
        self.generation_tokens = counter(names.GENERATION_TOKENS, "Number of generation tokens processed.")
        self.request_success = counter(names.REQUEST_SUCCESS, "Finished requests.")
        self.ttft = histogram(names.TTFT, "Time to first token in seconds.", TTFT_BUCKETS)
        self.itl = histogram(names.ITL, "Inter-token latency in seconds.", ITL_BUCKETS)
        self.e2e = histogram(names.E2E_LATENCY, "End-to-end request latency in seconds.", E2E_BUCKETS)
        self.prefix_cache_queries = counter(names.PREFIX_CACHE_QUERIES, "Prefix cache queries, in terms of "
                                            "number of queried tokens.")
        self.prefix_cache_hits = counter(names.PREFIX_CACHE_HITS, "Prefix cache hits, in terms of number of "
                                         "cached tokens.")
        self._rejected = Counter(names.REQUESTS_REJECTED, "Requests refused before the engine, by reason: "
                                 "the waiting queue full (waiting_requests, waiting_prompt_tokens: 429), "
                                 "body_too_large (413), body_timeout (408), prompt_too_long (400).",
                                 (*LABELS, "reason"), registry=r)
        self._labels = labels
        for reason in REJECT_REASONS:  # each reason reads 0 from the start (a rate() needs the series)
            self._rejected.labels(*labels, reason)
        self._last_totals = {"preemptions": 0, "prompt": 0, "generation": 0, "pc_queries": 0, "pc_hits": 0}
        declared = exported_connector_metrics() if connector_metrics is None else connector_metrics
        self.connector = ConnectorMetrics(declared, r, labels)

    # ---------------------------------------------------------------- engine thread
    def update_engine(self, snap: EngineSnapshot) -> None:
        self.num_requests_running.set(snap.num_running)
        self.num_requests_waiting.set(snap.num_waiting)
        self.num_waiting_prompt_tokens.set(snap.num_waiting_prompt_tokens)
        self.kv_cache_usage_perc.set(snap.kv_cache_usage)
        self.kv_pending_sends.set(snap.pending_sends)
        self.kv_pending_loads.set(snap.pending_loads)
        # the engine keeps cumulative totals; counters advance by the difference
        for key, value, counter in (
            ("preemptions", snap.num_preemptions_total, self.num_preemptions),
            ("prompt", snap.prompt_tokens_total, self.prompt_tokens),
            ("generation", snap.generation_tokens_total, self.generation_tokens),
            ("pc_queries", snap.prefix_cache_queries_total, self.prefix_cache_queries),
            ("pc_hits", snap.prefix_cache_hits_total, self.prefix_cache_hits),
        ):
            if value > self._last_totals[key]:
                counter.inc(value - self._last_totals[key])
                self._last_totals[key] = value

    def observe_connector_stats(self, stats: dict[str, Any]) -> None:
        """One step's connector stats, into the metrics the connectors declare. Keys no declaration names are
        ignored, so a new connector never breaks metrics."""
        self.connector.observe(stats)

    # ---------------------------------------------------------------- per request (event loop)
    def observe_finished(self, arrival: float, first_token: float | None, finished: float) -> None:
        """Monotonic times of one finished request."""
        self.request_success.inc()
        if first_token is not None:
            self.ttft.observe(first_token - arrival)
        self.e2e.observe(finished - arrival)

    def rejected(self, reason: str) -> None:
        self._rejected.labels(*self._labels, reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


def worker_metrics(engine: Any, role: str) -> WorkerMetrics:
    """A loaded engine's metrics: its served name, and the metrics its configured connector declares."""
    return WorkerMetrics(engine.served_model_name, role, exported_connector_metrics(engine.config.kv_transfer_config))
