"""The router in front of workers of either engine: readiness from /health where a worker has no /ready (vLLM),
least-loaded from what each worker's /metrics reports (vLLM's names, which our worker exports too)."""
from __future__ import annotations

import asyncio

import httpx

from disagg.worker.router.endpoints import EndpointPool, load_from_metrics
from disagg.worker.router.metrics import RouterMetrics
from disagg.worker.router.probes import probe_once
from disagg.worker.router.state import RouterState

VLLM_METRICS = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 3.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny"} 2.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="tiny",reason="capacity"} 7.0
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.25
vllm:num_requests_running_total 99
"""


def test_load_is_read_from_the_shared_metric_names():
    assert load_from_metrics(VLLM_METRICS) == (5.0, 0.25)
    two_engines = 'vllm:num_requests_running{engine="0"} 1\nvllm:num_requests_running{engine="1"} 2 1700000000\n'
    assert load_from_metrics(two_engines) == (3.0, 0.0)
    assert load_from_metrics("disagg:other 1\n") is None


class Servers:
    """url -> kind: 'vllm' (no /ready), 'disagg-ready', 'disagg-starting' (/ready 503), 'down', 'slow',
    'dropped' (a pooled connection the worker closed: the next request on it gets no answer; then 'vllm')."""

    def __init__(self, kinds: dict[str, str]):
        self.kinds, self.paths = kinds, []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        base = f"{request.url.scheme}://{request.url.host}:{request.url.port}"
        kind, path = self.kinds[base], request.url.path
        self.paths.append((base, path))
        if kind == "down":
            raise httpx.ConnectError("refused", request=request)
        if kind == "slow":
            raise httpx.ReadTimeout("timed out", request=request)
        if kind == "dropped":
            self.kinds[base] = "vllm"
            raise httpx.RemoteProtocolError("Server disconnected without sending a response.", request=request)
        if path == "/metrics":
            return httpx.Response(200, text=VLLM_METRICS if kind == "vllm" else "vllm:num_requests_running 0\n")
        if path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "tiny"}]})
        if path == "/ready":
            if kind == "vllm":
                return httpx.Response(404, json={"detail": "Not Found"})
            return httpx.Response(200 if kind == "disagg-ready" else 503)
        return httpx.Response(200)  # /health


def probe_rounds(state: RouterState, servers: Servers):
    """rounds(n): n probe rounds of `state` against `servers`."""
    def rounds(n: int) -> None:
        async def go() -> None:
            async with httpx.AsyncClient(transport=httpx.MockTransport(servers)) as client:
                state.client = client
                for _ in range(n):
                    await probe_once(state)
        asyncio.run(go())
    return rounds


def probed(kinds: dict[str, str], rounds: int = 2) -> tuple[RouterState, Servers]:
    servers = Servers(kinds)
    decode = EndpointPool("decode")
    decode.set_urls(list(kinds))
    state = RouterState(EndpointPool("prefill"), decode, RouterMetrics(), probe_interval_s=0.5)
    probe_rounds(state, servers)(rounds)
    return state, servers


def test_a_worker_without_ready_is_probed_on_health_and_one_with_ready_keeps_it():
    v, r, s, d = "http://v:1", "http://r:1", "http://s:1", "http://d:1"
    state, servers = probed({v: "vllm", r: "disagg-ready", s: "disagg-starting", d: "down"})
    eps = state.decode.endpoints
    assert eps[v].ready and eps[v].ready_path == "/health"
    assert eps[r].ready and eps[r].ready_path == "/ready"
    assert not eps[s].ready, "a disagg worker's 503 on /ready is not mistaken for a missing /ready"
    assert not eps[d].ready
    # the second round asks vLLM's /health directly, and never asks a not-ready worker for its metrics
    assert [p for b, p in servers.paths if b == v].count("/ready") == 1
    assert (s, "/metrics") not in servers.paths and (s, "/health") not in servers.paths


def test_least_loaded_follows_the_workers_reported_load():
    busy, idle = "http://busy:1", "http://idle:1"
    state, _ = probed({busy: "vllm", idle: "disagg-ready"})
    assert state.decode.endpoints[busy].reported_load == 5.0
    assert {state.decode.pick().url for _ in range(4)} == {idle}
    # this router's own in-flight requests count at once, before the next scrape
    state.decode.endpoints[idle].outstanding = 6
    assert state.decode.pick().url == busy


def test_a_ready_worker_that_answers_late_stays_ready_until_timeouts_repeat():
    """On a starved machine a busy vLLM answers /health late now and then; one late answer must not leave the
    pool without a decode endpoint (seen: 503s in a scale-down test); probes left unanswered for
    --unresponsive-after take it out. A refused connection counts at once."""
    url = "http://w:1"
    state, servers = probed({url: "vllm"}, rounds=1)
    ep = state.decode.endpoints[url]
    assert ep.ready

    rounds = probe_rounds(state, servers)

    servers.kinds[url] = "slow"
    rounds(3)
    assert ep.ready and not ep.unresponsive()
    ep.unanswered_since -= ep.unresponsive_after_s  # as if the first timed-out probe was sent that long ago
    rounds(1)
    assert not ep.ready and ep.unresponsive()
    servers.kinds[url] = "vllm"
    rounds(1)
    assert ep.ready and ep.probe_timeouts == 0 and not ep.unresponsive()
    servers.kinds[url] = "down"
    rounds(1)
    assert not ep.ready


def test_a_probe_on_a_dropped_keep_alive_connection_is_asked_again_not_taken_as_a_verdict():
    """A worker closes idle keep-alive connections; a probe that reused one just closed got no answer. Taken as
    "not ready", a busy worker whose next probes then timed out stayed out of the pool for a minute (a CI run:
    no decode endpoint, 503s during a vLLM scale-down). It is asked again at once on a fresh connection."""
    url = "http://w:1"
    state, servers = probed({url: "vllm"}, rounds=1)
    ep = state.decode.endpoints[url]
    servers.kinds[url] = "dropped"
    asked = len(servers.paths)

    rounds = probe_rounds(state, servers)

    rounds(1)
    assert ep.ready and ep.refused_at is None
    assert [p for _, p in servers.paths[asked:asked + 2]] == ["/health", "/health"]


def test_unresponsive_after_zero_never_takes_a_worker_out_by_its_probes():
    """--unresponsive-after 0: only the hop bounds judge a worker; probes that time out leave it ready."""
    url = "http://w:1"
    state, servers = probed({url: "vllm"}, rounds=1)
    ep = state.decode.endpoints[url]
    ep.unresponsive_after_s = 0.0
    servers.kinds[url] = "slow"

    rounds = probe_rounds(state, servers)

    rounds(2)
    ep.unanswered_since -= 3600
    rounds(1)
    assert ep.ready and not ep.unresponsive() and ep.probe_timeouts == 3
