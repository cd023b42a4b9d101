"""Prometheus metrics of the router, on its own CollectorRegistry (no global state): per hop (prefill,
decode) requests, errors and latency, and client requests by outcome. Labels as the workers' metrics."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client import CONTENT_TYPE_LATEST  # noqa: F401  (re-exported for the HTTP layer)

from disagg.worker.server.metrics import E2E_BUCKETS, LABELS, TTFT_BUCKETS


# The router's metric names, the one place they are written (a counter renders with "_total" appended)
HOP_REQUESTS = "disagg:router_hop_requests"
HOP_ERRORS = "disagg:router_hop_errors"
HOP_LATENCY = "disagg:router_hop_latency_seconds"
REQUESTS = "disagg:router_requests"
DECODE_ALONE = "disagg:router_decode_alone"
HOP_TIMEOUTS = "disagg:router_hop_timeouts"
EJECTIONS = "disagg:router_ejections"
BROKEN_STREAMS = "disagg:router_broken_streams"
PREFIX_PROMPT_TOKENS = "disagg:router_prefix_prompt_tokens"
PREFIX_HIT_TOKENS = "disagg:router_prefix_hit_tokens"
EARLY_FIRST_TOKENS = "disagg:router_early_first_tokens"
PREFILL_SKIPPED = "disagg:router_prefill_skipped"
KV_EVENTS = "disagg:router_kv_events"
KV_EVENTS_LOST = "disagg:router_kv_events_lost"
TTFT = "disagg:router_time_to_first_token_seconds"
REFUSED_PREFILL_TARGETS = "disagg:router_refused_prefill_targets"
SATURATED = "disagg:router_worker_saturated"  # counter: 429s from workers (their queue full), per hop
QUEUED = "disagg:router_queued_requests"  # gauge: requests waiting for room at a saturated pool, per hop
TASK_RESTARTS = "disagg:router_task_restarts"  # counter: background tasks that died and were restarted, per task
# KV hand-offs per endpoint, measured at the router for any engine (handoffs.py); labels endpoint (its URL) and
# endpoint_pod (its pod's name; not "pod", which a scrape's target labels own)
KV_PENDING_SENDS = "disagg:router_kv_pending_sends"
KV_PENDING_LOADS = "disagg:router_kv_pending_loads"
KV_OLDEST_SEND_AGE = "disagg:router_kv_oldest_pending_send_seconds"
KV_OLDEST_LOAD_AGE = "disagg:router_kv_oldest_pending_load_seconds"
HANDOFF_TO_FIRST_TOKEN = "disagg:router_handoff_to_first_token_seconds"
# counter, label `outcome` (freed: the prefill freed it now; gone: no longer kept there): hand-offs no decode took
KV_RELEASES = "disagg:router_kv_releases"
# requests held while no decode endpoint is ready (hold.py): the autoscaler's signal to scale from zero
HELD_REQUESTS = "disagg:router_held_requests"
COLD_START = "disagg:router_cold_start_seconds"
COLD_START_BUCKETS = (0.5, 1.0, 2.0, 5.0, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0, 90.0, 120.0, 180.0, 300.0, 600.0)
ENDPOINT_POD_LABEL = "endpoint_pod"
ENDPOINT_LABELS = ("endpoint", ENDPOINT_POD_LABEL)


class RouterMetrics:
    """Per hop (prefill, decode): requests sent, errors (connection failures, 5xx), latency of the hop."""

    def __init__(self, model_name: str = "", role: str = "router"):
        self.registry = CollectorRegistry()
        self.role = role  # the `role` label: router, epp (the gateway's endpoint picker), or the decode side's hop
        r = self.registry
        labels = (*LABELS, "hop")
        self.model_name = model_name  # "" until the router learns it from a worker
        self.hop_requests = Counter(HOP_REQUESTS, "Requests sent to a worker, per hop.", labels, registry=r)
        self.hop_errors = Counter(HOP_ERRORS, "Failed hops (connection error, 5xx, broken stream), per hop.",
                                  labels, registry=r)
        self.hop_latency = Histogram(HOP_LATENCY, "Hop latency: prefill until the response, decode until the last "
                                     "byte.", labels, buckets=E2E_BUCKETS, registry=r)
        self.requests = Counter(REQUESTS, "Requests answered, by outcome; a front door's (role router, epp: the "
                                "endpoint picker's picks) are the client requests, a pd-proxy's (role prefill, "
                                "decode) the ones it relayed to its engine (ok, bad_request, timeout, unavailable, "
                                "upstream_error; shed: 429, every worker at capacity; busy: 503, the router's "
                                "connections to workers all in use; client_gone: the client left first).",
                                (*LABELS, "outcome"), registry=r)
        self.saturated_total = Counter(SATURATED, "429s from workers (their waiting queue full), per hop: the "
                                       "endpoint is skipped until its Retry-After; never counted as a failure.",
                                       labels, registry=r)
        self.task_restarts = Counter(TASK_RESTARTS, "Background tasks (probes, discovery, KV events) that died and "
                                     "were restarted, per task.", (*LABELS, "task"), registry=r)
        self.kv_releases = Counter(KV_RELEASES, "Hand-offs no decode took whose prefill was asked to free the KV "
                                   "early, by outcome: freed, or gone (pulled or expired already).",
                                   (*LABELS, "outcome"), registry=r)
        self.decode_alone = Counter(DECODE_ALONE, "Client requests the decode worker computed alone: prefill "
                                    "endpoints are configured but none gave KV.", LABELS, registry=r)
        self.hop_timeouts = Counter(HOP_TIMEOUTS, "Hops that ran past a bound, per hop and stage (connect, "
                                    "first_byte, idle, total).", (*labels, "stage"), registry=r)
        self.ejections = Counter(EJECTIONS, "Worker endpoints ejected by outlier detection, per hop (role).",
                                 labels, registry=r)
        self.broken_streams = Counter(BROKEN_STREAMS, "Decode streams ended with an SSE error event after they had "
                                      "started, by cause (error, idle, total).", (*LABELS, "cause"), registry=r)
        self.prefix_prompt_tokens = Counter(PREFIX_PROMPT_TOKENS, "Prompt tokens of the requests routed by the "
                                            "prefix-aware policy.", LABELS, registry=r)
        self.prefix_hit_tokens = Counter(PREFIX_HIT_TOKENS, "Of those, the tokens the chosen decode endpoint held "
                                         "in its prefix cache (by its KV events).", LABELS, registry=r)
        self.early_first_tokens = Counter(EARLY_FIRST_TOKENS, "Streamed requests whose first token was sent from "
                                          "the prefill's answer, before the decode hop.", LABELS, registry=r)
        self.prefill_skipped = Counter(PREFILL_SKIPPED, "Requests sent to decode alone because it held all but a "
                                       "few blocks of the prompt.", LABELS, registry=r)
        self.kv_events_total = Counter(KV_EVENTS, "KV-cache events received from workers.", LABELS, registry=r)
        self.kv_events_lost_total = Counter(KV_EVENTS_LOST, "KV-cache event batches lost (sequence gaps not "
                                            "replayed, undecodable batches).", LABELS, registry=r)
        self.ttft = Histogram(TTFT, "Router-side time to the first streamed byte, from the request's arrival.",
                              LABELS, buckets=TTFT_BUCKETS, registry=r)
        self.handoff_latency = Histogram(HANDOFF_TO_FIRST_TOKEN, "From a prefill's hand-off to the first byte of "
                                         "the decode hop that carried it.", LABELS, buckets=TTFT_BUCKETS, registry=r)
        self.refused_targets = Counter(REFUSED_PREFILL_TARGETS, "Prefill endpoints named by a request's "
                                       "x-prefiller-host-port that are not of this resource's prefill pool (not "
                                       "contacted; decoded alone).", LABELS, registry=r)

        self.cold_start = Histogram(COLD_START, "Requests held while no decode endpoint was ready: from being held "
                                    "to the client's first byte.", LABELS, buckets=COLD_START_BUCKETS, registry=r)

        self.held: Callable[[], int] = lambda: 0  # requests held now (0 while holding is off), read when scraped
        self.registry.register(_HeldCollector(self))

    def watch_held(self, held: Callable[[], int]) -> None:
        """Export the requests held now (hold.HoldQueue.held), read at each scrape."""
        self.held = held

    def learned_model(self, name: str) -> None:
        """The served model's name, from a worker; the cold-start histogram is exported from then on (count 0), so
        a dashboard panel on it has a series before the first cold start."""
        self.model_name = name
        self.cold_start.labels(name, self.role)

    def cold_started(self, seconds: float) -> None:
        self.cold_start.labels(self.model_name, self.role).observe(seconds)

    def handoff_consumed(self, seconds: float) -> None:
        self.handoff_latency.labels(self.model_name, self.role).observe(seconds)

    def watch_handoffs(self, ledger: Any, members: Callable[[], list[tuple[str, str, str]]]) -> None:
        """Export the ledger's pending sends and loads per endpoint, read at each scrape; `members` gives the
        current (role, url, pod name) of every endpoint (each reads 0 when nothing is pending there)."""
        self.registry.register(_HandoffCollector(self, ledger, members))

    def refused_prefill_target(self) -> None:
        self.refused_targets.labels(self.model_name, self.role).inc()

    def hop(self, hop: str, latency_s: float, error: bool) -> None:
        self.hop_requests.labels(self.model_name, self.role, hop).inc()
        self.hop_latency.labels(self.model_name, self.role, hop).observe(latency_s)
        if error:
            self.hop_errors.labels(self.model_name, self.role, hop).inc()

    def saturated(self, hop: str) -> None:
        self.saturated_total.labels(self.model_name, self.role, hop).inc()

    def watch_queues(self, waiting: Callable[[], dict[str, int]]) -> None:
        """Export the requests waiting for room per pool (`waiting`: role -> count), read at each scrape."""
        self.registry.register(_QueueCollector(self, waiting))

    def task_restarted(self, task: str) -> None:
        self.task_restarts.labels(self.model_name, self.role, task).inc()

    def timed_out(self, hop: str, stage: str) -> None:
        self.hop_timeouts.labels(self.model_name, self.role, hop, stage).inc()

    def ejected(self, hop: str) -> None:
        self.ejections.labels(self.model_name, self.role, hop).inc()

    def stream_broken(self, cause: str) -> None:
        self.broken_streams.labels(self.model_name, self.role, cause).inc()

    def request(self, outcome: str) -> None:
        self.requests.labels(self.model_name, self.role, outcome).inc()

    def early_first_token(self) -> None:
        self.early_first_tokens.labels(self.model_name, self.role).inc()

    def kv_released(self, freed: bool) -> None:
        self.kv_releases.labels(self.model_name, self.role, "freed" if freed else "gone").inc()

    def fell_back_to_decode_alone(self) -> None:
        self.decode_alone.labels(self.model_name, self.role).inc()

    def first_byte(self, seconds: float) -> None:
        self.ttft.labels(self.model_name, self.role).observe(seconds)

    def prefix_decision(self, prompt_tokens: int, hit_tokens: int) -> None:
        self.prefix_prompt_tokens.labels(self.model_name, self.role).inc(prompt_tokens)
        self.prefix_hit_tokens.labels(self.model_name, self.role).inc(hit_tokens)

    def skipped_prefill(self) -> None:
        self.prefill_skipped.labels(self.model_name, self.role).inc()

    def kv_events_received(self, n: int) -> None:
        self.kv_events_total.labels(self.model_name, self.role).inc(n)

    def kv_events_lost(self, n: int) -> None:
        self.kv_events_lost_total.labels(self.model_name, self.role).inc(n)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _HandoffCollector:
    """Per-endpoint gauges computed from the hand-off ledger when scraped."""

    def __init__(self, metrics: RouterMetrics, ledger: Any, members: Callable[[], list[tuple[str, str, str]]]):
        self.metrics, self.ledger, self.members = metrics, ledger, members

    def collect(self) -> Any:
        sends, loads = self.ledger.pending()
        members = self.members()
        for name, doc, table, part, role in (
                (KV_PENDING_SENDS, "Hand-offs a prefill endpoint gave whose KV no decode has consumed yet "
                 "(until its lease ends).", sends, 0, "prefill"),
                (KV_OLDEST_SEND_AGE, "Age of the oldest of them.", sends, 1, "prefill"),
                (KV_PENDING_LOADS, "Decode hops carrying a hand-off, sent to the endpoint and not answered yet.",
                 loads, 0, "decode"),
                (KV_OLDEST_LOAD_AGE, "Age of the oldest of them.", loads, 1, "decode")):
            family = GaugeMetricFamily(name, doc, labels=[*LABELS, *ENDPOINT_LABELS])
            for member_role, url, pod in members:
                if member_role == role:
                    family.add_metric([self.metrics.model_name, self.metrics.role, url, pod],
                                      float(table.get(url, (0, 0.0))[part]))
            yield family


class _QueueCollector:
    """Requests waiting for room at a saturated pool (capacity.py), per hop, read when scraped."""

    def __init__(self, metrics: RouterMetrics, waiting: Callable[[], dict[str, int]]):
        self.metrics, self.waiting = metrics, waiting

    def collect(self) -> Any:
        family = GaugeMetricFamily(QUEUED, "Requests waiting for room at a pool whose every endpoint is saturated, "
                                   "per hop.", labels=[*LABELS, "hop"])
        counts = self.waiting()
        for hop in ("prefill", "decode"):
            family.add_metric([self.metrics.model_name, self.metrics.role, hop], float(counts.get(hop, 0)))
        yield family


class _HeldCollector:
    def __init__(self, metrics: RouterMetrics):
        self.metrics = metrics

    def collect(self) -> Any:
        family = GaugeMetricFamily(HELD_REQUESTS, "Requests held now, waiting for a decode endpoint to be ready.",
                                   labels=list(LABELS))
        family.add_metric([self.metrics.model_name, self.metrics.role], float(self.metrics.held()))
        yield family
