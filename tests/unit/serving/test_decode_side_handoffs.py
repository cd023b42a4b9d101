"""Behind a gateway, a vLLM decode pod's pd-proxy runs the prefill hop itself: the hand-off it got is a pending
send at that prefill (its per-endpoint view, which the autoscaler reads for vLLM pods) only until its engine
answers with it, as at the router - not until the lease ends."""
from __future__ import annotations

import json

import httpx
import pytest

from disagg.worker.router.decode_side import PREFILL_HEADER
from disagg.worker.router.endpoints import EndpointPool
from disagg.worker.router.metrics import RouterMetrics
from disagg.worker.router.pd_proxy import build_app
from disagg.worker.router.state import RouterState

PREFILL, ENGINE = "http://p1:1", "http://engine:1"
KV = {"do_remote_prefill": True, "remote_engine_id": "e", "remote_block_ids": [1], "remote_host": "h",
      "remote_port": 1, "remote_request_id": "r"}


def pd_proxy(engine_status: int) -> tuple[httpx.AsyncClient, RouterState, list[str]]:
    seen: list[str] = []

    def upstream(request: httpx.Request) -> httpx.Response:
        base = f"{request.url.scheme}://{request.url.host}:{request.url.port}"
        seen.append(base)
        if base == PREFILL:
            assert json.loads(request.content)["kv_transfer_params"] == {"do_remote_decode": True}
            return httpx.Response(200, json={"choices": [{"text": "x"}], "kv_transfer_params": KV})
        return httpx.Response(engine_status, json={"choices": [{"text": "decoded"}]})

    pools = []
    for role, url in (("prefill", PREFILL), ("decode", ENGINE)):
        pool = EndpointPool(role)
        pool.set_urls([url])
        pool.endpoints[url].ready = True
        pools.append(pool)
    state = RouterState(pools[0], pools[1], RouterMetrics("m", role="decode"))
    state.client = httpx.AsyncClient(transport=httpx.MockTransport(upstream))
    app = build_app(state, ENGINE, "decode", signer=None, lease_s=30.0)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://pd-proxy"), state, seen


@pytest.mark.asyncio
async def test_the_prefill_hops_hand_off_stops_being_pending_once_the_engine_answers():
    client, state, seen = pd_proxy(200)
    r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 4},
                          headers={PREFILL_HEADER: "p1:1"})
    assert r.status_code == 200 and seen == [PREFILL, ENGINE]
    assert state.handoffs.pending() == ({}, {})
    assert "disagg:router_handoff_to_first_token_seconds_count" in state.metrics.render().decode()


@pytest.mark.asyncio
async def test_a_hand_off_the_engine_failed_on_stays_pending_at_its_prefill():
    client, state, _ = pd_proxy(500)
    r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 4},
                          headers={PREFILL_HEADER: "p1:1"})
    assert r.status_code == 503
    sends, loads = state.handoffs.pending()
    assert list(sends) == [PREFILL] and sends[PREFILL][0] == 1 and loads == {}


@pytest.mark.asyncio
async def test_once_ready_says_the_engine_is_up_the_proxy_serves_with_it():
    """A vLLM pod coming back from zero: the proxy's earlier probes of its engine were refused (not listening
    yet). When its /ready answers 200 - the router then sends the held requests - its own hops must take the
    engine too, not answer 503 "no decode endpoint available" until their next probe round."""
    client, state, seen = pd_proxy(200)
    engine = state.decode.endpoints[ENGINE]
    engine.ready, engine.refused_at = False, 0.0
    health = {"status": 503}

    def probes(request: httpx.Request) -> httpx.Response:
        return httpx.Response(404 if request.url.path == "/ready" else health["status"])

    state.probe_client = httpx.AsyncClient(transport=httpx.MockTransport(probes))
    assert (await client.get("/ready")).status_code == 503  # loading: not ready
    health["status"] = 200
    assert (await client.get("/ready")).status_code == 200
    r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 4})
    assert r.status_code == 200 and seen == [ENGINE], r.text


@pytest.mark.asyncio
async def test_the_proxy_says_its_engine_cannot_release_kv_rather_than_passing_the_call_on():
    """vLLM has no call that frees unread KV before its lease: the router's release is answered 501 by the proxy
    (the router then stops asking this pod), never sent to vLLM as an unknown route."""
    client, _, seen = pd_proxy(200)
    r = await client.post("/v1/kv/release", json={"kv_transfer_params": KV})
    assert r.status_code == 501 and "lease" in r.json()["error"]["message"] and seen == []
