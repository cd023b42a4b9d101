"""The router's two-hop flow against mock workers (httpx.MockTransport): hop bodies, one X-Request-Id,
retries, decode-alone fallback, 503 without decode, 4xx pass-through, a decode stream broken midway."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from disagg.worker.router.app import build_app
from disagg.worker.router.endpoints import EndpointPool
from disagg.worker.router.hop_bodies import RELEASE_PATH
from disagg.worker.router.metrics import RouterMetrics
from disagg.worker.router.state import RouterState

KV = {"do_remote_prefill": True, "remote_engine_id": "e", "remote_block_ids": [1], "remote_host": "h",
      "remote_port": 1, "remote_request_id": "r"}
SSE = b'data: {"choices":[{"text":"hi"}]}\n\ndata: [DONE]\n\n'


class BrokenStream(httpx.AsyncByteStream):
    async def __aiter__(self):
        yield b'data: {"choices":[{"text":"a"}]}\n\n'
        raise httpx.ReadError("connection reset")


class SSEStream(httpx.AsyncByteStream):
    async def __aiter__(self):
        yield SSE


class Workers:
    """Scripted workers: url -> behaviour ('ok', 'down', '500', '400', 'broken'); records every request."""

    def __init__(self, behaviour: dict[str, str]):
        self.behaviour = behaviour
        self.seen: list[tuple[str, dict, str]] = []  # (url, body, x-request-id)
        self.released: list[tuple[str, dict]] = []  # the router's release calls: (prefill url, hand-off)

    def __call__(self, request: httpx.Request) -> httpx.Response:
        base = f"{request.url.scheme}://{request.url.host}:{request.url.port}"
        body = json.loads(request.content)
        if request.url.path == RELEASE_PATH:
            self.released.append((base, body["kv_transfer_params"]))
            if self.behaviour[base] == "vllm":  # pd-proxy in front of vLLM, which has no release call
                return httpx.Response(501, json={"error": {"message": "cannot free unread KV", "code": 501}})
            return httpx.Response(200, json={"released": True})
        self.seen.append((base, body, request.headers.get("x-request-id")))
        mode = self.behaviour[base]
        if mode == "down":
            raise httpx.ConnectError("refused", request=request)
        if mode in ("500", "400"):
            return httpx.Response(int(mode), json={"error": {"message": mode, "code": int(mode)}})
        if mode == "refuses-kv" and "kv_transfer_params" in body:  # as handoff_auth answers an expired lease
            return httpx.Response(403, json={"error": {
                "message": "kv_transfer_params.remote_lease_expires_at: the prefill's lease on this KV ended",
                "type": "permission_denied", "param": "kv_transfer_params.remote_lease_expires_at", "code": 403}})
        if body.get("kv_transfer_params", {}).get("do_remote_decode"):
            return httpx.Response(200, json={"choices": [{"text": "x"}], "kv_transfer_params": KV})
        if mode == "broken":
            return httpx.Response(200, stream=BrokenStream(), headers={"content-type": "text/event-stream"})
        if body.get("stream"):
            return httpx.Response(200, stream=SSEStream(), headers={"content-type": "text/event-stream"})
        return httpx.Response(200, json={"choices": [{"text": "decoded"}], "kv_transfer_params": None})


def router(prefill: dict[str, str], decode: dict[str, str]) -> tuple[httpx.AsyncClient, Workers, RouterState]:
    workers = Workers({**prefill, **decode})
    pools = []
    for role, urls in (("prefill", prefill), ("decode", decode)):
        pool = EndpointPool(role)
        pool.set_urls(list(urls))
        for ep in pool.endpoints.values():
            ep.ready = True
        pools.append(pool)
    state = RouterState(pools[0], pools[1], RouterMetrics("m"))
    state.client = httpx.AsyncClient(transport=httpx.MockTransport(workers))
    client = httpx.AsyncClient(transport=httpx.ASGITransport(build_app(state)), base_url="http://router")
    return client, workers, state


P1, P2, D1, D2 = "http://p1:1", "http://p2:1", "http://d1:1", "http://d2:1"


@pytest.mark.asyncio
async def test_two_hops_share_one_request_id_and_hand_over_kv_params():
    client, workers, state = router({P1: "ok"}, {D1: "ok"})
    r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 9, "stream_options": {}},
                          headers={"X-Request-Id": "abc"})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "decoded"
    (p_url, p_body, p_id), (d_url, d_body, d_id) = workers.seen
    assert (p_url, d_url, p_id, d_id) == (P1, D1, "abc", "abc")
    assert p_body["max_tokens"] == 1 and p_body["stream"] is False and "stream_options" not in p_body
    assert p_body["kv_transfer_params"] == {"do_remote_decode": True}
    assert d_body["max_tokens"] == 9 and d_body["kv_transfer_params"] == KV
    assert r.headers["x-request-id"] == "abc"
    assert "disagg:router_decode_alone_total{" not in state.metrics.render().decode()


@pytest.mark.asyncio
@pytest.mark.parametrize("failure", ["down", "500"])
async def test_failed_prefill_is_retried_on_another_prefill(failure):
    client, workers, state = router({P1: failure, P2: "ok"}, {D1: "ok"})
    state.prefill.endpoints[P2].outstanding = 5  # least-loaded picks P1 first
    r = await client.post("/v1/completions", json={"prompt": "x"})
    assert r.status_code == 200
    assert [u for u, _, _ in workers.seen] == [P1, P2, D1]
    assert workers.seen[-1][1]["kv_transfer_params"] == KV
    assert not state.prefill.endpoints[P1].ready, "a failed endpoint is skipped until the next probe"


@pytest.mark.asyncio
async def test_no_prefill_available_decodes_alone():
    client, workers, state = router({P1: "down"}, {D1: "ok"})
    r = await client.post("/v1/chat/completions", json={"messages": [], "kv_transfer_params": {"junk": 1}})
    assert r.status_code == 200
    assert [u for u, _, _ in workers.seen] == [P1, D1]
    assert "kv_transfer_params" not in workers.seen[-1][1], "decode alone computes the prompt itself"
    # counted for the DisaggRouterDecodeAlone alert; a request with KV from a prefill is not
    assert 'disagg:router_decode_alone_total{model_name="m",role="router"} 1.0' in state.metrics.render().decode()
    await client.post("/v1/chat/completions", json={"messages": []})
    assert 'disagg:router_decode_alone_total{model_name="m",role="router"} 2.0' in state.metrics.render().decode()


@pytest.mark.asyncio
async def test_no_decode_endpoint_is_a_clear_503():
    client, _, state = router({P1: "ok"}, {D1: "ok"})
    state.decode.endpoints[D1].ready = False
    state.decode.endpoints[D1].refused_at = 0.0  # down: its probes are refused (not one starting: waited for)
    r = await client.post("/v1/completions", json={"prompt": "x"})
    assert r.status_code == 503
    assert "no decode endpoint available" in r.json()["error"]["message"]


@pytest.mark.asyncio
async def test_prefill_4xx_is_passed_back_without_a_decode_hop():
    client, workers, _ = router({P1: "400"}, {D1: "ok"})
    r = await client.post("/v1/completions", json={"prompt": "x"})
    assert r.status_code == 400 and [u for u, _, _ in workers.seen] == [P1]


@pytest.mark.asyncio
@pytest.mark.parametrize("body", [b"{not json", b"[1]", b'{"prompt": "x", "max_tokens": 0}'])
async def test_bad_requests_are_rejected_before_any_hop(body):
    client, workers, _ = router({P1: "ok"}, {D1: "ok"})
    r = await client.post("/v1/completions", content=body)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert workers.seen == []


@pytest.mark.asyncio
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
async def test_a_hand_off_the_decode_refuses_is_decoded_alone_not_a_403_to_the_client(stream):
    """The router made the hand-off, so its refusal (the request waited at the decode past the prefill's lease:
    seen with vLLM pods under load) is no client error: the decode computes the prompt itself."""
    client, workers, state = router({P1: "ok"}, {D1: "refuses-kv"})
    r = await client.post("/v1/completions", json={"prompt": "x", "stream": stream})
    assert r.status_code == 200, r.text
    assert r.content == SSE if stream else r.json()["choices"][0]["text"] == "decoded"
    assert [u for u, _, _ in workers.seen] == [P1, D1, D1]
    assert workers.seen[1][1]["kv_transfer_params"] == KV and "kv_transfer_params" not in workers.seen[2][1]
    assert 'disagg:router_decode_alone_total{model_name="m",role="router"} 1.0' in state.metrics.render().decode()
    assert state.decode.endpoints[D1].outstanding == 0 and state.decode.endpoints[D1].ready
    await asyncio.sleep(0.05)  # the release goes out in the background
    assert workers.released == [(P1, KV)], "the refused hand-off's KV is freed at its prefill, not at the lease"


@pytest.mark.asyncio
async def test_a_decode_4xx_about_the_request_is_passed_back_once():
    client, workers, state = router({P1: "ok"}, {D1: "400"})
    r = await client.post("/v1/completions", json={"prompt": "x"})
    assert r.status_code == 400 and [u for u, _, _ in workers.seen] == [P1, D1]
    assert "disagg:router_decode_alone_total{" not in state.metrics.render().decode()
    await asyncio.sleep(0.05)
    assert workers.released == [(P1, KV)]  # the decode refused the request, so nobody reads its KV


@pytest.mark.asyncio
async def test_a_prefill_that_cannot_release_kv_is_asked_once_and_a_decode_that_failed_never():
    """vLLM's pd-proxy answers the release 501: the router stops asking that prefill (its KV goes at the lease
    end). A decode hop that failed without refusing (a 5xx: it may have started reading) gets no release."""
    client, workers, state = router({P1: "vllm"}, {D1: "400"})
    for _ in range(3):
        assert (await client.post("/v1/completions", json={"prompt": "x"})).status_code == 400
        await asyncio.sleep(0.02)
    assert workers.released == [(P1, KV)] and P1 in state.handoffs.cannot_release
    assert sum(state.handoffs.pending()[0][P1][:1]) == 3  # still pending there, until their lease end
    client, workers, state = router({P1: "ok"}, {D1: "500"})
    assert (await client.post("/v1/completions", json={"prompt": "x"})).status_code == 503
    await asyncio.sleep(0.05)
    assert workers.released == [] and state.handoffs.pending()[0][P1][0] == 1


@pytest.mark.asyncio
async def test_decode_failing_before_its_first_byte_is_retried_on_another_decode():
    client, workers, state = router({P1: "ok"}, {D1: "down", D2: "ok"})
    state.decode.endpoints[D2].outstanding = 5
    r = await client.post("/v1/completions", json={"prompt": "x", "stream": True})
    assert r.status_code == 200 and r.content == SSE
    assert [u for u, _, _ in workers.seen] == [P1, D1, D2]
    assert state.decode.endpoints[D2].outstanding == 5, "outstanding counts are released"


@pytest.mark.asyncio
async def test_decode_broken_mid_stream_ends_with_an_sse_error():
    client, _, state = router({P1: "ok"}, {D1: "broken"})
    r = await client.post("/v1/completions", json={"prompt": "x", "stream": True})
    events = [e for e in r.text.split("\n\n") if e]
    assert events[0] == 'data: {"choices":[{"text":"a"}]}'
    assert json.loads(events[1][len("data: "):])["error"]["code"] == 502
    assert events[-1] == "data: [DONE]"
    assert state.decode.endpoints[D1].outstanding == 0
    metrics = state.metrics.render().decode()
    assert 'disagg:router_hop_errors_total{hop="decode",model_name="m",role="router"} 1.0' in metrics


@pytest.mark.asyncio
async def test_rollout_pairs_prefill_and_decode_of_the_same_revision():
    client, workers, state = router({P1: "ok", P2: "ok"}, {D1: "ok", D2: "ok"})
    revs = {P1: "old", D1: "old", P2: "new", D2: "new"}
    for pool in (state.prefill, state.decode):
        for ep in pool.endpoints.values():
            ep.revision = revs[ep.url]
    for _ in range(6):
        r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 4})
        assert r.status_code == 200
    pairs = [(workers.seen[i][0], workers.seen[i + 1][0]) for i in range(0, len(workers.seen), 2)]
    assert {revs[p] == revs[d] for p, d in pairs} == {True}
    assert {p for p, _ in pairs} == {P1, P2}  # both revisions keep serving while both exist


@pytest.mark.asyncio
async def test_kv_never_crosses_revisions_when_the_prefills_decode_revision_is_gone():
    """Mid-rollout the last old decode goes away after the old prefill computed the prompt: the new decode gets
    the request without the old revision's KV (it may not fit its engine) and computes the prompt itself."""
    client, workers, state = router({P1: "ok"}, {D1: "down", D2: "ok"})
    revs = {P1: "old", D1: "old", D2: "new"}
    for pool in (state.prefill, state.decode):
        for ep in pool.endpoints.values():
            ep.revision = revs[ep.url]
    r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 4})
    assert r.status_code == 200, r.text
    assert [url for url, _, _ in workers.seen] == [P1, D1, D2]
    assert workers.seen[1][1]["kv_transfer_params"] == KV  # the old decode would have pulled it
    assert "kv_transfer_params" not in workers.seen[2][1]
    assert b"disagg:router_decode_alone_total" in state.metrics.render()


@pytest.mark.asyncio
async def test_the_hops_run_without_the_router_app_and_honour_a_named_prefill():
    """A decode-side hop (a gateway's picker named the prefill): the hop protocol called directly, the plan's
    costs putting the named prefill endpoint first; no FastAPI app in between."""
    from disagg.worker.router.hops import prefill_hop, serve
    from disagg.worker.router.policy import RoutePlan
    from disagg.worker.router.timeouts import Deadline, HopTimeouts

    _, workers, state = router({P1: "ok", P2: "ok"}, {D1: "ok"})
    state.prefill.endpoints[P2].outstanding = 5  # by load alone P1 would go first
    named = RoutePlan(prefill_costs={P2: 0.0})
    reply = await serve(state, named, "/v1/completions", {"prompt": "x"}, {"X-Request-Id": "r1"},
                        Deadline(HopTimeouts()))
    assert reply.status == 200 and json.loads(reply.content)["choices"][0]["text"] == "decoded"
    assert [u for u, _, _ in workers.seen] == [P2, D1] and workers.seen[-1][1]["kv_transfer_params"] == KV
    outcome = await prefill_hop(state, named, "/v1/completions", {"prompt": "x"}, {"X-Request-Id": "r2"},
                                Deadline(HopTimeouts()))
    assert outcome.handoff.to_wire() == KV and workers.seen[-1][0] == P2
