"""With no decode endpoint (pools scaled to zero) the router holds requests in a bounded queue: they go on the
moment a decode endpoint is ready (decode alone while no prefill is), the held count and the cold start are
exported, and beyond the queue's bounds the client gets 429/503 with Retry-After - never a hang."""
from __future__ import annotations

import asyncio
import functools
import json
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from disagg.worker.router.app import build_app
from disagg.worker.router.endpoints import EndpointPool
from disagg.worker.router.hold import HoldQueue, HoldSettings
from disagg.worker.router.metrics import COLD_START, HELD_REQUESTS, RouterMetrics
from disagg.worker.router.probes import probe_not_ready
from disagg.worker.router.state import RouterState
from disagg.worker.router.timeouts import HopTimeouts

P, D = "http://p:1", "http://d:1"
KV = {"do_remote_prefill": True, "remote_engine_id": "e", "remote_block_ids": [1], "remote_host": "h",
      "remote_port": 1, "remote_request_id": "r"}


class Fleet:
    """Workers behind a mock transport: /ready answers 200 once a worker is `up`; the decode records whether each
    request came with a prefill's hand-off."""

    def __init__(self) -> None:
        self.up: set[str] = set()
        self.decoded: list[bool] = []  # per decode request: carried kv_transfer_params

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        base = f"{request.url.scheme}://{request.url.host}:{request.url.port}"
        if base not in self.up:
            raise httpx.ConnectError("connection refused", request=request)
        if request.url.path == "/ready":
            return httpx.Response(200, json={"ready": True})
        if request.url.path in ("/metrics", "/v1/models"):
            return httpx.Response(404)
        body = json.loads(request.content)
        if body.get("kv_transfer_params", {}).get("do_remote_decode"):
            return httpx.Response(200, json={"choices": [{"text": "x"}], "kv_transfer_params": KV})
        self.decoded.append("kv_transfer_params" in body)
        if body.get("stream"):
            sse = b'data: {"choices": [{"text": "decoded"}]}\n\ndata: [DONE]\n\n'
            return httpx.Response(200, stream=httpx.ByteStream(sse), headers={"content-type": "text/event-stream"})
        return httpx.Response(200, json={"choices": [{"text": "decoded"}]})


def router(settings: HoldSettings, prefill_urls: list[str] = ()) -> RouterState:
    prefill, decode = EndpointPool("prefill"), EndpointPool("decode")
    prefill.set_urls(list(prefill_urls))
    metrics = RouterMetrics("m")
    state = RouterState(prefill, decode, metrics, timeouts=HopTimeouts(1.0, 2.0, 2.0, 5.0))
    state.hold = HoldQueue(settings, functools.partial(probe_not_ready, state))
    metrics.watch_held(lambda: state.hold.held)
    return state


def sample(state: RouterState, name: str) -> float:
    for family in text_string_to_metric_families(state.metrics.render().decode()):
        for s in family.samples:
            if s.name == name:
                return s.value
    raise AssertionError(f"{name} not exported")


async def _post(c: httpx.AsyncClient, stream: bool = False) -> httpx.Response:
    return await c.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 4, "stream": stream})


def run(state: RouterState, fleet: Fleet, scenario) -> object:
    async def go():
        state.client = httpx.AsyncClient(transport=httpx.MockTransport(fleet))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(build_app(state)), base_url="http://r") as c:
            return await scenario(c)
    return asyncio.run(go())


def test_held_requests_go_on_when_a_decode_appears_decode_alone_until_prefill_is_ready():
    fleet, state = Fleet(), router(HoldSettings(seconds=10, max_requests=10), prefill_urls=[P])
    seen = {}

    async def scenario(c):
        tasks = [asyncio.ensure_future(_post(c, stream=i % 2 == 0)) for i in range(6)]
        await asyncio.sleep(0.3)
        seen["held"] = sample(state, HELD_REQUESTS)
        seen["ready"] = (await c.get("/ready")).status_code  # stays in its Service while holding
        t0 = time.monotonic()
        state.decode.set_urls([D])  # the decode pool came back (discovery); the prefill is still starting
        fleet.up.add(D)
        answers = await asyncio.gather(*tasks)
        seen["released_in"] = time.monotonic() - t0
        fleet.up.add(P)
        await probe_not_ready(state, state.prefill)
        answers.append(await _post(c))  # now P/D
        return answers

    answers = run(state, fleet, scenario)
    assert [r.status_code for r in answers] == [200] * 7, [r.text for r in answers]
    assert seen["held"] == 6 and seen["ready"] == 200
    assert seen["released_in"] < 1.0, seen  # probed at once, not at a probe round
    assert fleet.decoded == [False] * 6 + [True]  # decode alone while no prefill was ready, then P/D
    assert sample(state, HELD_REQUESTS) == 0
    assert sample(state, COLD_START + "_count") == 6


def test_a_request_held_past_hold_seconds_gets_503_with_retry_after():
    fleet, state = Fleet(), router(HoldSettings(seconds=0.4, max_requests=10))

    async def scenario(c):
        t0 = time.monotonic()
        r = await _post(c)
        return r, time.monotonic() - t0

    r, took = run(state, fleet, scenario)
    assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
    assert "0.4 s" in r.json()["error"]["message"] and 0.4 <= took < 1.5, (r.text, took)
    assert sample(state, HELD_REQUESTS) == 0


def test_one_request_beyond_max_held_requests_gets_429_at_once():
    fleet, state = Fleet(), router(HoldSettings(seconds=2, max_requests=2))

    async def scenario(c):
        held = [asyncio.ensure_future(_post(c)) for _ in range(2)]
        await asyncio.sleep(0.2)
        t0 = time.monotonic()
        extra = await _post(c)
        took = time.monotonic() - t0
        state.decode.set_urls([D])
        fleet.up.add(D)
        return extra, took, await asyncio.gather(*held)

    extra, took, held = run(state, fleet, scenario)
    assert extra.status_code == 429 and extra.headers["retry-after"] == "2" and took < 0.5, extra.text
    assert "at most 2" in extra.json()["error"]["message"]
    assert [r.status_code for r in held] == [200, 200]


def test_hold_settings_are_checked():
    assert HoldSettings(-1, 0).problems() == ["--hold-seconds must be >= 0, got -1",
                                              "--max-held-requests must be >= 1, got 0"]
    assert not HoldSettings().enabled and HoldSettings(600).retry_after_s == 30


def test_the_endpoint_picker_holds_too_and_refuses_with_retry_after_when_the_hold_runs_out():
    from disagg.worker.gateway.ext_proc import PickRequest
    from disagg.worker.gateway.picker import RoutingPicker

    fleet = Fleet()
    body = json.dumps({"model": "m", "prompt": "hi", "max_tokens": 4}).encode()
    request = PickRequest("POST", "/v1/completions", {}, body)

    async def go(state: RouterState, appear_after_s: float | None):
        state.client = httpx.AsyncClient(transport=httpx.MockTransport(fleet))
        picker = RoutingPicker(state)
        task = asyncio.ensure_future(picker.pick(request))
        if appear_after_s is not None:
            await asyncio.sleep(appear_after_s)
            state.decode.set_urls([D])
            fleet.up.add(D)
        return await task

    refused = asyncio.run(go(router(HoldSettings(seconds=0.3)), None))
    assert (refused.status, refused.retry_after_s) == (503, 1) and "0.3 s" in refused.message
    picked = asyncio.run(go(router(HoldSettings(seconds=5)), 0.3))
    assert (picked.status, picked.decode) == (200, "d:1"), picked
