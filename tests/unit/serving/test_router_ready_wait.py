"""With no decode endpoint ready, the router waits (at most its connect bound) for one that answers its probes
"not ready" - a pod starting, as in a rollout's hand-over, ready a moment before the next probe round - and
probes it meanwhile; hung, gone and ejected endpoints are not waited for, so their clients are told at once."""
from __future__ import annotations

import asyncio
import json
import time

import httpx

from disagg.worker.router import outliers
from disagg.worker.router.app import build_app
from disagg.worker.router.endpoints import EndpointPool
from disagg.worker.router.metrics import RouterMetrics
from disagg.worker.router.state import RouterState
from disagg.worker.router.timeouts import HopTimeouts

P, D = "http://p:1", "http://d:1"
KV = {"do_remote_prefill": True, "remote_engine_id": "e", "remote_block_ids": [1], "remote_host": "h",
      "remote_port": 1, "remote_request_id": "r"}
BOUNDS = HopTimeouts(connect_s=1.0, first_byte_s=2.0, idle_s=2.0, total_s=5.0)


class Fleet:
    """A prefill that serves, and a decode whose /ready says 503 until `ready_at` (monotonic), or refuses."""

    def __init__(self, ready_after_s: float | None, refuse: bool = False):
        self.ready_at = None if ready_after_s is None else time.monotonic() + ready_after_s
        self.refuse = refuse
        self.ready_probes = 0

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        base = f"{request.url.scheme}://{request.url.host}:{request.url.port}"
        if base == D and self.refuse:
            raise httpx.ConnectError("connection refused", request=request)
        if request.url.path in ("/ready", "/metrics", "/v1/models"):
            if base == D and request.url.path == "/ready":
                self.ready_probes += 1
                ready = self.ready_at is not None and time.monotonic() >= self.ready_at
                return httpx.Response(200 if ready else 503, json={"ready": ready})
            return httpx.Response(404)
        body = json.loads(request.content)
        if body.get("kv_transfer_params", {}).get("do_remote_decode"):
            return httpx.Response(200, json={"choices": [{"text": "x"}], "kv_transfer_params": KV})
        return httpx.Response(200, json={"choices": [{"text": "decoded"}]})


def routed(fleet: Fleet, decode_state: str) -> tuple[httpx.Response, float, RouterState]:
    prefill, decode = EndpointPool("prefill"), EndpointPool("decode")
    prefill.set_urls([P])
    decode.set_urls([D])
    prefill.endpoints[P].ready = True
    d = decode.endpoints[D]
    d.ready_path = "/ready"  # probed before: it answered "not ready" (starting)
    if decode_state == "hung":
        d.probe_timed_out(time.monotonic())
    elif decode_state == "gone":
        d.refused_at = time.monotonic()
    elif decode_state == "ejected":
        outliers.on_failure(d.health, outliers.OutlierPolicy(1, 30.0, 60.0), time.monotonic(), timed_out=True)
    state = RouterState(prefill, decode, RouterMetrics("m"), timeouts=BOUNDS)

    async def go() -> tuple[httpx.Response, float]:
        state.client = httpx.AsyncClient(transport=httpx.MockTransport(fleet))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(build_app(state)), base_url="http://r") as c:
            t0 = time.monotonic()
            r = await c.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 4})
            return r, time.monotonic() - t0

    r, took = asyncio.run(go())
    return r, took, state


def test_a_request_waits_for_a_starting_decode_and_is_served_once_it_is_ready():
    fleet = Fleet(ready_after_s=0.35)
    r, took, state = routed(fleet, "starting")
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "decoded", r.text
    assert 0.35 <= took < BOUNDS.connect_s, took
    assert state.decode.endpoints[D].ready and fleet.ready_probes >= 2  # probed while waiting, not at a round


def test_a_decode_that_never_gets_ready_is_a_503_after_the_connect_bound():
    r, took, _ = routed(Fleet(ready_after_s=None), "starting")
    assert r.status_code == 503 and "no decode endpoint available" in r.json()["error"]["message"], r.text
    assert BOUNDS.connect_s <= took < BOUNDS.connect_s + 0.5, took


def test_hung_gone_or_ejected_decodes_are_not_waited_for():
    for decode_state in ("hung", "gone", "ejected"):
        fleet = Fleet(ready_after_s=0.0)  # its /ready would even say yes: no request probes it
        r, took, _ = routed(fleet, decode_state)
        assert r.status_code == 503, (decode_state, r.text)
        assert took < 0.3 and fleet.ready_probes == 0, (decode_state, took, fleet.ready_probes)
