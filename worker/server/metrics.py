"""Prometheus metrics of a worker, on its own CollectorRegistry (no global state).

Names (metric_names.py), types and meanings follow vLLM where vLLM has the metric (dashboards, KEDA triggers and
routers work unchanged); the rest carries the `disagg:` prefix. Every metric has `model_name` and `role` labels.
"""
from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST  # noqa: F401  (re-exported for the HTTP layers)

from disagg.worker import metric_names as names
from disagg.worker.engine.stats import EngineSnapshot

LABELS = ("model_name", "role")

# seconds; vLLM's buckets for request latencies
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)
XFER_TIME_BUCKETS = (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
BYTES_BUCKETS = tuple(float(2**k) for k in range(10, 34, 2))  # 1 KiB .. 8 GiB
DESCRIPTOR_BUCKETS = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 1024.0, 4096.0)


class WorkerMetrics:
    def __init__(self, model_name: str, role: str):
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
        self.e2e = histogram(names.E2E_LATENCY, "End-to-end request latency in seconds.",
                             E2E_BUCKETS)
        self.nixl_xfer_time = histogram(names.NIXL_XFER_TIME, "Transfer duration for NIXL KV cache "
                                        "transfers.", XFER_TIME_BUCKETS)
        self.nixl_post_time = histogram(names.NIXL_POST_TIME, "Transfer post time for NIXL KV cache "
                                        "transfers.", XFER_TIME_BUCKETS)
        self.nixl_bytes = histogram(names.NIXL_BYTES, "Number of bytes transferred per NIXL KV "
                                    "cache transfer.", BYTES_BUCKETS)
        self.nixl_descriptors = histogram(names.NIXL_DESCRIPTORS, "Number of descriptors per NIXL KV cache "
                                          "transfer.", DESCRIPTOR_BUCKETS)
        self.nixl_failed = counter(names.NIXL_FAILED_TRANSFERS, "Number of failed NIXL KV cache transfers.")
        self.nixl_expired = counter(names.NIXL_EXPIRED_REQS, "Requests whose KV blocks expired unread "
                                    "(lease).")
        self.kv_bytes_loaded = counter(names.KV_BYTES_LOADED, "KV-cache bytes received from another worker "
                                       "(any connector).")
        self.kv_bytes_saved = counter(names.KV_BYTES_SAVED, "KV-cache bytes written for another worker "
                                      "(connectors that push, e.g. shared storage).")
        self.prefix_cache_queries = counter(names.PREFIX_CACHE_QUERIES, "Prefix cache queries, in terms of "
                                            "number of queried tokens.")
        self.prefix_cache_hits = counter(names.PREFIX_CACHE_HITS, "Prefix cache hits, in terms of number of "
                                         "cached tokens.")
        self._last_totals = {"preemptions": 0, "prompt": 0, "generation": 0, "pc_queries": 0, "pc_hits": 0}

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
        """One step's connector stats (NIXL: lists per transfer; shared storage: byte counts). Unknown keys are
        ignored so a new connector never breaks metrics."""
        for value in stats.get("xfer_time_s", ()):
            self.nixl_xfer_time.observe(value)
        for value in stats.get("post_time_s", ()):
            self.nixl_post_time.observe(value)
        for value in stats.get("bytes", ()):
            self.nixl_bytes.observe(value)
            self.kv_bytes_loaded.inc(value)
        for value in stats.get("num_descriptors", ()):
            self.nixl_descriptors.observe(value)
        if stats.get("num_failed_transfers"):
            self.nixl_failed.inc(stats["num_failed_transfers"])
        if stats.get("num_kv_expired_reqs"):
            self.nixl_expired.inc(stats["num_kv_expired_reqs"])
        if stats.get("bytes_loaded"):
            self.kv_bytes_loaded.inc(stats["bytes_loaded"])
        if stats.get("bytes_saved"):
            self.kv_bytes_saved.inc(stats["bytes_saved"])

    # ---------------------------------------------------------------- per request (event loop)
    def observe_finished(self, arrival: float, first_token: float | None, finished: float) -> None:
        """Monotonic times of one finished request."""
        self.request_success.inc()
        if first_token is not None:
            self.ttft.observe(first_token - arrival)
        self.e2e.observe(finished - arrival)

    def render(self) -> bytes:
        return generate_latest(self.registry)
