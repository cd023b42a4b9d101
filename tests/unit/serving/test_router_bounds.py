"""The router's bounds and outlier detection against scripted workers (httpx.MockTransport) that hang: a hung
prefill fails over, a hung decode is a 504 before anything streamed, a stream gone silent ends with an SSE error
event, the total caps every hop; failed endpoints are ejected, for longer each time, and come back."""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from scripted_router import scripted_router

from disagg.worker.router import outliers
from disagg.worker.router.endpoints import EndpointPool
from disagg.worker.router.outliers import Health, OutlierPolicy
from disagg.worker.router.state import RouterState
from disagg.worker.router.timeouts import Deadline, HopTimeout, HopTimeouts, within

KV = {"do_remote_prefill": True, "remote_engine_id": "e", "remote_block_ids": [1], "remote_host": "h",
      "remote_port": 1, "remote_request_id": "r"}
P1, P2, D1, D2 = "http://p1:1", "http://p2:1", "http://d1:1", "http://d2:1"
BOUNDS = HopTimeouts(connect_s=1.0, first_byte_s=0.3, idle_s=0.3, total_s=2.0)
HANG_S = 30.0  # far past every bound: a hang


class Stream(httpx.AsyncByteStream):
    def __init__(self, chunks: list[bytes], then_hang: bool):
        self.chunks, self.then_hang = chunks, then_hang

    async def __aiter__(self):
        for c in self.chunks:
            yield c
        if self.then_hang:
            await asyncio.sleep(HANG_S)


class Workers:
    """url -> 'ok' | 'hang' (no answer) | 'silent' (a stream's first chunk, then nothing) | 'slow:<s>'."""

    def __init__(self, behaviour: dict[str, str]):
        self.behaviour = behaviour
        self.seen: list[str] = []

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        base = f"{request.url.scheme}://{request.url.host}:{request.url.port}"
        body = json.loads(request.content)
        self.seen.append(base)
        mode = self.behaviour[base]
        if mode == "hang":
            await asyncio.sleep(HANG_S)
        if mode.startswith("slow:"):
            await asyncio.sleep(float(mode[5:]))
        if body.get("kv_transfer_params", {}).get("do_remote_decode"):
            return httpx.Response(200, json={"choices": [{"text": "x"}], "kv_transfer_params": KV})
        if body.get("stream"):
            chunks = [b'data: {"choices":[{"text":"a"}]}\n\n'] + ([] if mode == "silent" else [b"data: [DONE]\n\n"])
            return httpx.Response(200, stream=Stream(chunks, mode == "silent"),
                                  headers={"content-type": "text/event-stream"})
        return httpx.Response(200, json={"choices": [{"text": "decoded"}]})


def router(prefill: dict[str, str], decode: dict[str, str], bounds: HopTimeouts = BOUNDS,
           policy: OutlierPolicy = OutlierPolicy(2, 5.0, 60.0)) -> tuple[httpx.AsyncClient, Workers, RouterState]:
    workers = Workers({**prefill, **decode})
    client, state = scripted_router(list(prefill), list(decode), workers, {"outlier_policy": policy}, timeouts=bounds)
    return client, workers, state


def sample(state: RouterState, name: str, **labels: str) -> float:
    want = {"model_name": "m", "role": "router", **labels}
    for family in text_string_to_metric_families(state.metrics.render().decode()):
        for s in family.samples:
            if s.name == name and s.labels == want:
                return s.value
    return 0.0


def reready(state: RouterState) -> None:
    """What the next readiness probe of a worker that answers again does."""
    for ep in [*state.prefill.endpoints.values(), *state.decode.endpoints.values()]:
        ep.ready = True


@pytest.mark.asyncio
async def test_hung_prefill_fails_over_to_another_prefill_within_its_first_byte_bound_and_is_ejected():
    client, workers, state = router({P1: "hang", P2: "ok"}, {D1: "ok"})
    t0 = time.monotonic()
    r = await client.post("/v1/completions", json={"prompt": "x"})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "decoded"
    assert time.monotonic() - t0 < BOUNDS.first_byte_s + 1.0
    assert workers.seen == [P1, P2, D1]
    assert sample(state, "disagg:router_hop_timeouts_total", hop="prefill", stage="first_byte") == 1
    assert sample(state, "disagg:router_ejections_total", hop="prefill") == 1
    reready(state)  # its probe passes (a slow, not a stopped, worker): still ejected
    workers.seen.clear()
    for _ in range(3):
        assert (await client.post("/v1/completions", json={"prompt": "x"})).status_code == 200
    assert P1 not in workers.seen, "an ejected endpoint is not chosen while another is available"
    assert (await client.get("/endpoints")).json()["prefill"][0]["ejected"] is True


@pytest.mark.asyncio
async def test_the_only_prefill_hung_means_decode_alone():
    client, workers, state = router({P1: "hang"}, {D1: "ok"})
    r = await client.post("/v1/completions", json={"prompt": "x", "kv_transfer_params": {"x": 1}})
    assert r.status_code == 200
    assert workers.seen == [P1, D1]
    assert sample(state, "disagg:router_decode_alone_total") == 1


@pytest.mark.asyncio
@pytest.mark.parametrize("stream", [True, False])
async def test_hung_decode_is_a_504_json_error_before_anything_streamed(stream):
    client, workers, state = router({P1: "ok"}, {D1: "hang"})
    t0 = time.monotonic()
    r = await client.post("/v1/completions", json={"prompt": "x", "stream": stream})
    took = time.monotonic() - t0
    assert r.status_code == 504 and r.headers["content-type"] == "application/json"
    error = r.json()["error"]
    assert error["type"] == "timeout" and error["code"] == 504 and D1 in error["message"]
    # a stream's first chunk is bounded by first_byte; a non-streamed answer only by the total
    bound = BOUNDS.first_byte_s if stream else BOUNDS.total_s
    assert bound - 0.05 < took < bound + 1.0
    stage = "first_byte" if stream else "total"
    assert sample(state, "disagg:router_hop_timeouts_total", hop="decode", stage=stage) == 1
    assert sample(state, "disagg:router_requests_total", outcome="timeout") == 1
    assert state.decode.ejected() == [state.decode.endpoints[D1]]


@pytest.mark.asyncio
async def test_hung_decode_fails_over_to_another_decode_before_anything_streamed():
    client, workers, state = router({P1: "ok"}, {D1: "hang", D2: "ok"})
    r = await client.post("/v1/completions", json={"prompt": "x", "stream": True})
    assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
    assert workers.seen == [P1, D1, D2]
    assert workers.seen[-1] == D2


@pytest.mark.asyncio
async def test_a_non_streamed_decode_on_a_worker_whose_probes_stop_answering_fails_over_before_the_total():
    client, workers, state = router({P1: "ok"}, {D1: "hang", D2: "ok"})
    state.decode.endpoints[D2].outstanding = 1  # the first pick is D1

    async def probes_time_out() -> None:  # what the probe loop records for a stopped process
        await asyncio.sleep(0.3)
        state.decode.endpoints[D1].probe_timed_out(time.monotonic() - 100)

    t0 = time.monotonic()
    _, r = await asyncio.gather(probes_time_out(), client.post("/v1/completions", json={"prompt": "x"}))
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "decoded"
    assert time.monotonic() - t0 < BOUNDS.total_s - 0.5, "abandoned when the probes said so, not at the total"
    assert workers.seen == [P1, D1, D2]
    assert sample(state, "disagg:router_hop_timeouts_total", hop="decode", stage="unresponsive") == 1


class Ticking(httpx.AsyncByteStream):
    """A stream that keeps answering: a chunk every 0.1 s."""

    async def __aiter__(self):
        for _ in range(15):
            await asyncio.sleep(0.1)
            yield b'data: {"choices":[{"text":"a"}]}\n\n'
        yield b"data: [DONE]\n\n"


@pytest.mark.asyncio
async def test_a_flooded_worker_that_answers_hops_but_not_its_probes_is_not_taken_for_hung():
    """Under a flood a worker's event loop answers /ready late (its probes time out for long) while it still
    streams and answers: that is no hung process. A request waiting for its answer is not abandoned as
    "unresponsive", and the worker is not ejected (overload must not become an outage)."""
    async def worker(request: httpx.Request) -> httpx.Response:
        if json.loads(request.content).get("stream"):
            return httpx.Response(200, stream=Ticking(), headers={"content-type": "text/event-stream"})
        await asyncio.sleep(0.6)  # busy: it answers, late
        return httpx.Response(200, json={"choices": [{"text": "decoded"}]})

    bounds = HopTimeouts(connect_s=1.0, first_byte_s=3.0, idle_s=1.0, total_s=5.0)
    client, state = scripted_router([], [D1], worker, timeouts=bounds)
    ep = state.decode.endpoints[D1]

    async def stream() -> httpx.Response:
        return await client.post("/v1/completions", json={"prompt": "x", "stream": True})

    async def late_answer() -> httpx.Response:
        await asyncio.sleep(0.2)  # the stream is going; the probes have timed out for long
        ep.probe_timed_out(time.monotonic() - 100)
        return await client.post("/v1/completions", json={"prompt": "y"})

    streamed, answered = await asyncio.gather(stream(), late_answer())
    assert streamed.status_code == 200 and "error" not in streamed.text
    assert answered.status_code == 200 and answered.json()["choices"][0]["text"] == "decoded", answered.text
    assert sample(state, "disagg:router_hop_timeouts_total", hop="decode", stage="unresponsive") == 0
    assert state.decode.ejected() == []


@pytest.mark.asyncio
async def test_a_stream_gone_silent_ends_with_an_sse_error_event_and_is_counted():
    client, workers, state = router({P1: "ok"}, {D1: "silent"})
    t0 = time.monotonic()
    r = await client.post("/v1/completions", json={"prompt": "x", "stream": True})
    assert time.monotonic() - t0 < BOUNDS.idle_s + 1.0
    assert r.status_code == 200  # the stream had started: the error is in it
    events = [e for e in r.text.split("\n\n") if e]
    assert events[0] == 'data: {"choices":[{"text":"a"}]}'
    error = json.loads(events[1].removeprefix("data: "))["error"]
    assert error["code"] == 504 and error["type"] == "timeout" and "mid-stream" in error["message"]
    assert events[2] == "data: [DONE]"
    assert sample(state, "disagg:router_broken_streams_total", cause="idle") == 1
    assert state.decode.endpoints[D1].outstanding == 0
    assert state.decode.ejected() == [state.decode.endpoints[D1]]


@pytest.mark.asyncio
async def test_the_total_bound_caps_all_hops_together():
    # each hop within its own bound, both together past the total
    bounds = HopTimeouts(connect_s=1.0, first_byte_s=1.0, idle_s=1.0, total_s=1.2)
    client, workers, state = router({P1: "slow:0.7"}, {D1: "slow:0.7"}, bounds)
    t0 = time.monotonic()
    r = await client.post("/v1/completions", json={"prompt": "x", "stream": True})
    assert r.status_code == 504 and "1.2 s" in r.json()["error"]["message"]
    assert time.monotonic() - t0 < bounds.total_s + 0.5
    assert sample(state, "disagg:router_hop_timeouts_total", hop="decode", stage="total") == 1


@pytest.mark.asyncio
async def test_within_names_the_bound_that_ended_the_wait():
    d = Deadline(HopTimeouts(connect_s=1, first_byte_s=0.1, idle_s=5, total_s=10))
    with pytest.raises(HopTimeout) as e:
        await within(asyncio.sleep(5), d, "first_byte")
    assert e.value.stage == "first_byte" and "0.1 s" in str(e.value)
    d = Deadline(HopTimeouts(connect_s=1, first_byte_s=5, idle_s=5, total_s=0.1))
    with pytest.raises(HopTimeout) as e:
        await within(asyncio.sleep(5), d, "first_byte")
    assert e.value.stage == "total" and "total bound of 0.1 s" in str(e.value)
    assert await within(asyncio.sleep(0, "done"), Deadline(HopTimeouts()), "idle") == "done"


def test_bounds_and_outlier_settings_are_checked_by_name():
    assert HopTimeouts(0, 1, 1, 1).problems() == ["--connect-timeout must be > 0 seconds, got 0"]
    assert HopTimeouts().problems() == [] and OutlierPolicy().problems() == []
    assert len(OutlierPolicy(0, 5, 1).problems()) == 2  # consecutive < 1, max < base


# ---------------------------------------------------------------- outlier detection (pure)
def test_consecutive_failures_eject_and_each_ejection_in_a_row_doubles_up_to_the_max():
    policy, h = OutlierPolicy(consecutive_failures=2, base_ejection_s=5, max_ejection_s=12), Health()
    assert outliers.on_failure(h, policy, 0.0, timed_out=False) is None  # one failure: not yet
    assert outliers.on_failure(h, policy, 1.0, timed_out=False) == 5
    assert outliers.is_ejected(h, 5.9) and not outliers.is_ejected(h, 6.0)
    assert outliers.on_failure(h, policy, 7.0, timed_out=True) == 10  # a timeout ejects at once; doubled
    assert outliers.on_failure(h, policy, 8.0, timed_out=True) is None  # already out: no new ejection
    assert outliers.on_failure(h, policy, 18.0, timed_out=True) == 12  # capped


def test_a_success_resets_failures_and_a_long_healthy_spell_resets_the_ejection_length():
    policy, h = OutlierPolicy(2, 5, 100), Health()
    outliers.on_failure(h, policy, 0.0, timed_out=False)
    outliers.on_success(h, 0.5)
    assert outliers.on_failure(h, policy, 1.0, timed_out=False) is None, "failures in a row only"
    assert outliers.on_failure(h, policy, 1.0, timed_out=True) == 5  # out until 6
    outliers.on_success(h, 7.0)  # back, but not healthy for 5 s yet
    assert outliers.on_failure(h, policy, 7.5, timed_out=True) == 10  # out until 17.5
    outliers.on_success(h, 30.0)  # healthy 12.5 s > 10 s
    assert outliers.on_failure(h, policy, 31.0, timed_out=True) == 5


def test_pool_leaves_ejected_endpoints_out_unless_none_other_is_ready():
    now = [0.0]
    pool = EndpointPool("decode", "round-robin", outlier_policy=OutlierPolicy(1, 5, 60), clock=lambda: now[0])
    pool.set_urls([D1, D2])
    for ep in pool.endpoints.values():
        ep.ready = True
    assert pool.mark_failed(pool.endpoints[D1]) == 5
    pool.endpoints[D1].ready = True  # its probe passes again
    assert [pool.pick().url for _ in range(3)] == [D2] * 3
    pool.endpoints[D2].ready = False  # an ejection never empties a pool whose probes pass
    assert pool.pick().url == D1
    pool.endpoints[D2].ready = True
    now[0] = 5.0  # the ejection ran out: chosen again
    assert {pool.pick().url for _ in range(4)} == {D1, D2}
