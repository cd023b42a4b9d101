"""The router under overload, against scripted workers (httpx.MockTransport): a worker's 429 and a full hop pool
are answered, never counted against the worker; a saturated endpoint is skipped until its Retry-After or until
room is freed there; with every endpoint saturated the request waits briefly, then is shed with a 429 (before
any prefill work when the decode pool is saturated); probes go out on their own client; a client that leaves
cancels the hop; background tasks are restarted and /health says so while one is down; the drain's timeout ends
open streams with an error event."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from scripted_router import scripted_router

from disagg.worker.router.app import answered, route
from disagg.worker.router.endpoints import EndpointPool
from disagg.worker.router.hop_bodies import RELEASE_PATH
from disagg.worker.router.probes import probe_once
from disagg.worker.router.replies import Reply
from disagg.worker.router.state import RouterState
from disagg.worker.router.supervision import Supervisor

KV = {"do_remote_prefill": True, "remote_engine_id": "e", "remote_block_ids": [1], "remote_host": "h",
      "remote_port": 1, "remote_request_id": "r"}
P1, P2, D1, D2 = "http://p1:1", "http://p2:1", "http://d1:1", "http://d2:1"
BODY = {"prompt": "x", "max_tokens": 4}


class Stalled(httpx.AsyncByteStream):
    """A stream that sends one chunk and then nothing; closed meanwhile, its read fails (as a real connection's)."""

    def __init__(self):
        self.closed = asyncio.Event()

    async def __aiter__(self):
        yield b'data: {"choices":[{"text":"a"}]}\n\n'
        await self.closed.wait()
        raise httpx.ReadError("closed")

    async def aclose(self):
        self.closed.set()


class Chunks(httpx.AsyncByteStream):
    def __init__(self, chunks: list[bytes]):
        self.chunks = chunks

    async def __aiter__(self):
        for c in self.chunks:
            yield c


class Workers:
    """url -> 'ok' | '429' | 'pool' (the hop pool is full) | 'stall' (a stream that stops after one chunk)."""

    def __init__(self, behaviour: dict[str, str]):
        self.behaviour = behaviour
        self.seen: list[str] = []
        self.released: list[str] = []  # the router's release calls (KV no decode took), by prefill

    def __call__(self, request: httpx.Request) -> httpx.Response:
        base = f"{request.url.scheme}://{request.url.host}:{request.url.port}"
        if request.url.path == RELEASE_PATH:
            self.released.append(base)
            return httpx.Response(200, json={"released": True})
        self.seen.append(base)
        mode = self.behaviour[base]
        if mode == "pool":
            raise httpx.PoolTimeout("no connection in the pool", request=request)
        if mode == "429":
            return httpx.Response(429, headers={"Retry-After": "2"},
                                  json={"error": {"message": "full", "code": 429}})
        body = json.loads(request.content)
        if body.get("kv_transfer_params", {}).get("do_remote_decode"):
            return httpx.Response(200, json={"choices": [{"text": "x"}], "kv_transfer_params": KV})
        if mode == "stall":
            return httpx.Response(200, stream=Stalled(), headers={"content-type": "text/event-stream"})
        return httpx.Response(200, json={"choices": [{"text": "decoded"}]})


def router(prefill: dict[str, str], decode: dict[str, str], queue_wait_s: float = 0.2):
    workers = Workers({**prefill, **decode})
    client, state = scripted_router(list(prefill), list(decode), workers, queue_wait_s=queue_wait_s)
    return client, workers, state


def untouched(state: RouterState, url: str, role: str = "decode") -> bool:
    """Ready, no failure counted, never ejected: a 429 or a full pool is no verdict on the worker."""
    ep = getattr(state, role).endpoints[url]
    return ep.ready and ep.health.failures == 0 and ep.health.ejections == 0


def metric(state: RouterState, name: str, **labels: str) -> float:
    return state.metrics.registry.get_sample_value(name, {"model_name": "m", "role": "router", **labels}) or 0.0


# ---------------------------------------------------------------- the pure part: saturation and credits
def test_a_saturated_endpoint_is_skipped_until_its_retry_after_or_until_room_is_freed_there():
    now = [100.0]
    pool = EndpointPool("decode", "round-robin", clock=lambda: now[0])
    pool.set_urls([D1, D2])
    for ep in pool.endpoints.values():
        ep.ready = True
    d1, d2 = pool.endpoints[D1], pool.endpoints[D2]
    pool.mark_saturated(d1, 2.0)
    assert {pool.pick().url for _ in range(4)} == {D2} and not pool.saturated_only()
    pool.mark_saturated(d2, 1.0)
    assert pool.pick() is None and pool.saturated_only() and pool.saturation_ends_in() == 1.0
    d1.outstanding = 1
    assert pool.released(d1) and d1.outstanding == 0  # a request of ours finished there: room for one
    assert pool.pick() is d1 and pool.pick() is None  # the credit is spent
    now[0] += 2.5
    assert not pool.saturated_only() and pool.pick() is not None
    assert not pool.released(d2)  # not saturated any more: no credit


def test_what_an_endpoint_held_at_its_429_is_its_capacity_at_the_door_then_grows_and_is_forgotten():
    now = [100.0]
    pool = EndpointPool("decode", "round-robin", clock=lambda: now[0])
    pool.set_urls([D1, D2])
    for ep in pool.endpoints.values():
        ep.ready = True
    d1, d2 = pool.endpoints[D1], pool.endpoints[D2]
    d1.outstanding = 3  # the refused request still counted: it held 2
    pool.mark_saturated(d1, 1.0)
    assert not pool.door_limited() and not pool.door_full(), "D2's capacity is unknown: the door stays open"
    d2.outstanding = 2  # refused after its count was released: it held 2
    pool.mark_saturated(d2, 1.0, refused_counted=False)
    d1.outstanding = 2
    assert pool.door_limited() and pool.door_full()  # 4 in flight, 4 held
    d1.outstanding = 1
    assert not pool.door_full()
    pool.pending = 1  # one in its prefill hop, bound for the pool
    assert pool.door_full()
    pool.pending = 0
    assert pool.door_full(committed=1)  # one whose first token was sent, waiting for room
    now[0] += 5.1  # no 429 since: room may have grown - one more each (a tenth, at least one)
    assert d1.door_capacity(now[0]) == 3 and not pool.door_full(committed=2) and pool.door_full(committed=3)
    d1.capacity_seen = 40
    assert d1.door_capacity(now[0]) == 44 and d1.door_capacity(now[0] + 5) == 48
    now[0] += 60  # a minute without a 429: nothing known, the door is open
    assert d1.door_capacity(now[0]) is None and not pool.door_limited() and not pool.door_full(committed=100)


# ---------------------------------------------------------------- 429s
@pytest.mark.asyncio
async def test_a_decode_429_moves_the_request_to_another_decode_and_is_no_failure():
    client, workers, state = router({P1: "ok"}, {D1: "429", D2: "ok"})
    for _ in range(3):
        r = await client.post("/v1/completions", json=BODY)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "decoded"
    assert workers.seen.count(D1) == 1  # skipped while saturated
    assert untouched(state, D1) and metric(state, "disagg:router_worker_saturated_total", hop="decode") == 1


@pytest.mark.asyncio
async def test_every_decode_saturated_sheds_with_retry_after_and_costs_no_prefill():
    client, workers, state = router({P1: "ok"}, {D1: "429", D2: "429"})
    r = await client.post("/v1/completions", json=BODY)
    assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_exceeded"
    assert 1 <= int(r.headers["retry-after"]) <= 2
    prefills = workers.seen.count(P1)
    r = await client.post("/v1/completions", json={**BODY, "stream": True})  # both still saturated
    assert r.status_code == 429 and r.headers["retry-after"]
    assert workers.seen.count(P1) == prefills, "a request shed for want of a decode costs no prefill hop"
    assert untouched(state, D1) and untouched(state, D2)
    assert metric(state, "disagg:router_requests_total", outcome="shed") == 2


@pytest.mark.asyncio
async def test_a_request_shed_at_the_door_is_refused_before_its_body_is_read():
    """Under a flood nearly every request is refused: at a saturated decode pool the 429 comes from the request's
    headers alone (its body never read, not even waited for), and an authorised client's request id is kept."""
    client, workers, state = router({P1: "ok"}, {D1: "429"}, queue_wait_s=0.05)
    assert (await client.post("/v1/completions", json=BODY)).status_code == 429  # D1 told it is full
    app = client._transport.app  # noqa: SLF001 - the ASGI app under the client
    sent: list[dict] = []

    async def receive() -> dict:
        raise AssertionError("the body was read")

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "raw_path": b"/v1/completions",
             "query_string": b"", "headers": [(b"content-type", b"application/json"), (b"content-length", b"999"),
                                              (b"x-request-id", b"req-7")], "http_version": "1.1",
             "scheme": "http", "server": ("router", 80), "client": ("127.0.0.1", 5), "root_path": ""}
    await asyncio.wait_for(app(scope, receive, send), 2.0)
    start, body = sent
    headers = dict(start["headers"])
    assert start["status"] == 429 and int(headers[b"retry-after"]) >= 1 and headers[b"x-request-id"] == b"req-7"
    assert json.loads(body["body"])["error"]["type"] == "rate_limit_exceeded"
    assert workers.seen.count(P1) == 1 and metric(state, "disagg:router_requests_total", outcome="shed") == 2
    state.decode.endpoints[D1].saturated_until = 0.0  # room again: the next request is read and served
    workers.behaviour[D1] = "ok"
    r = await client.post("/v1/completions", json=BODY, headers={"x-request-id": "req-8"})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "decoded"


@pytest.mark.asyncio
async def test_one_fast_failure_at_the_only_decode_refuses_no_later_request_while_its_probes_answer_late():
    """The only decode answered one 500 and its probes time out (a busy engine answers them late): the next
    requests still go to it (a pool with nothing ready routes to what only failed fast, as Envoy's panic
    threshold does) instead of a 503 each until a probe answers. A decode side's own engine is never taken out
    by its hops at all; a timed-out hop still takes an endpoint out."""
    client, workers, state = router({}, {D1: "ok"})
    d1 = state.decode.endpoints[D1]
    answers = iter([httpx.Response(500, json={"error": {"message": "boom"}})])

    def worker(request: httpx.Request) -> httpx.Response:
        workers.seen.append(D1)
        return next(answers, None) or httpx.Response(200, json={"choices": [{"text": "decoded"}]})

    state.client = httpx.AsyncClient(transport=httpx.MockTransport(worker))
    r = await client.post("/v1/completions", json=BODY)
    assert r.status_code == 503 and not d1.ready  # the one that met the 500
    d1.probe_timed_out(asyncio.get_running_loop().time())  # its probe runs late: no verdict
    for _ in range(3):
        r = await client.post("/v1/completions", json=BODY)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "decoded", r.text
    assert workers.seen.count(D1) == 4
    state.decode.mark_failed(d1, timed_out=True)  # a hung worker is not panicked into
    assert state.decode.available() == []
    own = EndpointPool("decode", judged_by_hops=False)
    own.set_urls([D2])
    own.endpoints[D2].ready = True
    assert own.mark_failed(own.endpoints[D2], timed_out=True) is None and own.available() == [own.endpoints[D2]]


@pytest.mark.asyncio
async def test_a_request_waiting_for_room_takes_the_room_a_finished_request_frees():
    client, workers, state = router({}, {D1: "ok"}, queue_wait_s=5.0)
    d1 = state.decode.endpoints[D1]
    state.decode.mark_saturated(d1, 30.0)
    d1.outstanding = 1  # one request of ours is running there
    waiting = asyncio.ensure_future(client.post("/v1/completions", json=BODY))
    await asyncio.sleep(0.2)
    assert not waiting.done() and state.room(state.decode).waiting == 1
    from disagg.worker.router.capacity import released
    released(state, state.decode, d1)  # it finished: the waiter goes
    r = await asyncio.wait_for(waiting, 5)
    assert r.status_code == 200 and workers.seen == [D1]


@pytest.mark.asyncio
async def test_a_request_whose_200_was_sent_is_never_shed_and_takes_the_first_room_freed():
    """The early first token sent the 200 before the decode hop: shedding it then would cut a started answer."""
    from disagg.worker.router.capacity import Shed, next_endpoint, released
    from disagg.worker.router.policy import RoutePlan
    from disagg.worker.router.timeouts import Deadline

    _, _, state = router({}, {D1: "ok"}, queue_wait_s=0.3)
    d1 = state.decode.endpoints[D1]
    state.decode.mark_saturated(d1, 30.0)
    d1.outstanding = 2

    def pick():
        return state.pick_decode(RoutePlan(), set(), None)

    def waiter(committed: bool) -> asyncio.Future:
        return asyncio.ensure_future(next_endpoint(state, state.decode, pick, set(), Deadline(state.timeouts),
                                                   committed=committed))

    newcomer, committed = waiter(False), waiter(True)
    await asyncio.sleep(0.5)  # past the queue wait
    assert isinstance(newcomer.result(), Shed) and not committed.done()
    later, committed_later = waiter(False), waiter(True)
    await asyncio.sleep(0.05)
    released(state, state.decode, d1)  # room for one: the committed requests take it first, in arrival order
    assert await asyncio.wait_for(committed, 1) is d1 and not committed_later.done() and not later.done()
    released(state, state.decode, d1)
    assert await asyncio.wait_for(committed_later, 1) is d1 and not later.done()
    assert isinstance(await asyncio.wait_for(later, 5), Shed)


@pytest.mark.asyncio
async def test_while_a_started_answer_waits_for_a_decode_new_requests_get_no_room_and_no_prefill():
    """The early first token sent the 200; the decode answers 429: that request waits for room, and a request
    arriving meanwhile is shed at the door (no prefill) even once the decode has room - the room is the started
    answer's."""
    client, _, state = router({P1: "ok"}, {D1: "ok"}, queue_wait_s=0.3)
    asked = []
    decode_full = True

    def worker(request: httpx.Request) -> httpx.Response:
        asked.append(request.url.host)
        if request.url.host == "p1":
            return httpx.Response(200, json={"id": "cmpl-1", "model": "m", "created": 1, "choices": [{"text": " x"}],
                                             "kv_transfer_params": {**KV, "output_token_ids": [7]}})
        if decode_full:
            return httpx.Response(429, headers={"Retry-After": "30"}, json={"error": {"message": "full"}})
        return httpx.Response(200, stream=Chunks([b'data: {"choices":[{"text":" y"}]}\n\n', b"data: [DONE]\n\n"]),
                              headers={"content-type": "text/event-stream"})

    state.client = httpx.AsyncClient(transport=httpx.MockTransport(worker))
    started = asyncio.ensure_future(client.post("/v1/completions", json={**BODY, "stream": True}))
    while state.room(state.decode).committed_in_line == 0:
        await asyncio.sleep(0.01)
    assert asked == ["p1", "d1"]
    d1 = state.decode.endpoints[D1]
    d1.credits = 1  # room at D1 (as a request of ours finishing there gives), taken by no newcomer:
    late = await asyncio.wait_for(client.post("/v1/completions", json={**BODY, "stream": True}), 5)
    assert late.status_code == 429 and late.headers["retry-after"] and asked == ["p1", "d1"]
    decode_full = False
    state.room(state.decode).notify(1)
    r = await asyncio.wait_for(started, 5)
    assert r.status_code == 200 and '" x"' in r.text and '" y"' in r.text and "error" not in r.text
    assert asked == ["p1", "d1", "d1"] and state.room(state.decode).committed_in_line == 0


@pytest.mark.asyncio
async def test_after_a_decode_429_the_door_admits_no_more_than_the_decode_held_and_spends_no_prefill_on_the_rest():
    """A decode that held two requests refused a third: past its Retry-After, while it still holds two, a new
    request waits at the door - no prefill hop, no decode hop - and is shed; once one of the two finishes, the
    next is served."""
    client, _, state = router({P1: "ok"}, {D1: "ok"}, queue_wait_s=0.3)
    asked: list[str] = []
    released: list[str] = []
    held = asyncio.Event()
    holding = 2

    async def worker(request: httpx.Request) -> httpx.Response:
        nonlocal holding
        if request.url.path == RELEASE_PATH:
            released.append(request.url.host)
            return httpx.Response(200, json={"released": True})
        asked.append(request.url.host)
        if request.url.host == "p1":
            return httpx.Response(200, json={"choices": [{"text": "x"}], "kv_transfer_params": KV})
        if holding:
            holding -= 1
            await held.wait()
            return httpx.Response(200, json={"choices": [{"text": "decoded"}]})
        if state.decode.endpoints[D1].outstanding > 2:
            return httpx.Response(429, headers={"Retry-After": "1"}, json={"error": {"message": "full"}})
        return httpx.Response(200, json={"choices": [{"text": "decoded"}]})

    state.client = httpx.AsyncClient(transport=httpx.MockTransport(worker))
    first = [asyncio.ensure_future(client.post("/v1/completions", json=BODY)) for _ in range(2)]
    while state.decode.endpoints[D1].outstanding < 2:
        await asyncio.sleep(0.01)
    r = await client.post("/v1/completions", json=BODY)  # refused by the decode after its prefill
    assert r.status_code == 429 and asked.count("p1") == 3
    await asyncio.sleep(0.05)  # (the release goes out in the background)
    assert released == ["p1"], "the KV of the hand-off the decode refused is freed at its prefill now"
    await asyncio.sleep(1.1)  # the decode's Retry-After ran out; it still holds the two
    assert not state.decode.saturated_only() and state.decode.door_full()
    r = await client.post("/v1/completions", json=BODY)
    assert r.status_code == 429 and r.headers["retry-after"] and "at capacity" in r.json()["error"]["message"]
    assert asked.count("p1") == 3 and asked.count("d1") == 3, "shed at the door: no prefill, no decode hop"
    held.set()
    assert all(r.status_code == 200 for r in await asyncio.gather(*first))
    r = await client.post("/v1/completions", json=BODY)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "decoded"
    assert untouched(state, D1) and state.decode.pending == 0


@pytest.mark.asyncio
async def test_every_prefill_saturated_sheds_rather_than_decoding_alone():
    client, workers, state = router({P1: "429", P2: "429"}, {D1: "ok"})
    r = await client.post("/v1/completions", json=BODY)
    assert r.status_code == 429 and r.headers["retry-after"] and D1 not in workers.seen
    assert untouched(state, P1, "prefill") and untouched(state, P2, "prefill")
    client, workers, state = router({P1: "429", P2: "ok"}, {D1: "ok"})
    r = await client.post("/v1/completions", json=BODY)
    assert r.status_code == 200 and workers.seen[-2:] == [P2, D1]


@pytest.mark.asyncio
@pytest.mark.parametrize("full", ["prefill", "decode"])
async def test_a_full_hop_pool_is_a_503_with_retry_after_and_no_verdict_on_the_worker(full):
    client, workers, state = router({P1: "pool" if full == "prefill" else "ok"},
                                    {D1: "pool" if full == "decode" else "ok"})
    r = await client.post("/v1/completions", json=BODY)
    assert r.status_code == 503 and r.headers["retry-after"] == "1" and "all in use" in r.json()["error"]["message"]
    assert untouched(state, P1, "prefill") and untouched(state, D1)
    assert metric(state, "disagg:router_requests_total", outcome="busy") == 1


# ---------------------------------------------------------------- probes on their own client
@pytest.mark.asyncio
async def test_probes_go_out_on_their_own_client_even_when_the_hop_pool_is_full():
    _, _, state = router({}, {D1: "pool"})
    asked = []

    def worker(request: httpx.Request) -> httpx.Response:
        asked.append(request.url.path)
        return httpx.Response(200, text="vllm:num_requests_running{} 3\n")

    state.probe_client = httpx.AsyncClient(transport=httpx.MockTransport(worker))
    await probe_once(state)
    assert "/ready" in asked and state.decode.endpoints[D1].ready


# ---------------------------------------------------------------- a client that leaves
class StayingClient:
    """A request (the parts the router reads) whose client stays."""

    def __init__(self, body: dict):
        self.headers, self._body = {}, json.dumps(body).encode()

    async def body(self) -> bytes:
        return self._body

    async def receive(self):
        await asyncio.sleep(3600)


class LeavingClient:
    """A request whose client disconnects after `after_s`."""

    def __init__(self, after_s: float):
        self.after_s = after_s

    async def receive(self):
        await asyncio.sleep(self.after_s)
        return {"type": "http.disconnect"}


@pytest.mark.asyncio
async def test_a_client_that_leaves_cancels_the_hop_it_waits_on():
    _, _, state = router({}, {D1: "ok"})
    cancelled = asyncio.Event()

    async def hop() -> Reply:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    reply = await asyncio.wait_for(answered(state, LeavingClient(0.1), hop()), 5)
    assert reply.status == 499 and cancelled.is_set()
    assert metric(state, "disagg:router_requests_total", outcome="client_gone") == 1


@pytest.mark.asyncio
@pytest.mark.parametrize("how", ["closed", "cancelled"])
async def test_a_client_that_leaves_mid_stream_is_counted_client_gone_not_ok_and_no_verdict_on_the_worker(how):
    """The framework closes the stream's generator (or cancels the task reading it) when its client leaves."""
    _, _, state = router({}, {D1: "stall"})
    reply = await route(state, StayingClient({**BODY, "stream": True}), "/v1/completions")
    chunks = reply.stream
    assert (await chunks.__anext__()).startswith(b"data: {")
    if how == "closed":
        await chunks.aclose()
    else:
        reading = asyncio.ensure_future(chunks.__anext__())
        await asyncio.sleep(0.05)
        reading.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reading
    assert metric(state, "disagg:router_requests_total", outcome="client_gone") == 1
    assert metric(state, "disagg:router_requests_total", outcome="ok") == 0
    assert metric(state, "disagg:router_hop_errors_total", hop="decode") == 0
    assert untouched(state, D1) and not state.drain.streams
    assert state.decode.endpoints[D1].outstanding == 0  # its room is free again


# ---------------------------------------------------------------- background tasks
@pytest.mark.asyncio
async def test_a_background_task_that_dies_is_restarted_counted_and_health_says_so_meanwhile():
    client, _, state = router({}, {D1: "ok"})
    runs = []

    async def flaky() -> None:
        runs.append(1)
        if len(runs) == 1:
            raise RuntimeError("lost the API server")
        await asyncio.sleep(3600)

    supervisor = Supervisor(state.metrics, state.down)
    supervisor.start("discovery", flaky)
    await asyncio.sleep(0.1)
    r = await client.get("/health")
    assert r.status_code == 503 and "lost the API server" in r.json()["down"]["discovery"]
    await asyncio.sleep(0.6)  # the first backoff
    assert len(runs) == 2 and (await client.get("/health")).status_code == 200
    assert metric(state, "disagg:router_task_restarts_total", task="discovery") == 1
    await supervisor.stop()


# ---------------------------------------------------------------- draining
@pytest.mark.asyncio
async def test_draining_turns_ready_503_and_the_drain_timeout_ends_open_streams_with_an_error_event():
    client, _, state = router({}, {D1: "stall"})
    assert (await client.get("/ready")).status_code == 200
    state.drain.draining = True
    r = await client.get("/ready")
    assert r.status_code == 503 and r.json()["reason"] == "draining"
    reply = await route(state, StayingClient({**BODY, "stream": True}), "/v1/completions")
    chunks = reply.stream
    assert (await chunks.__anext__()).startswith(b"data: {")
    state.drain.cut()
    rest = [e for chunk in [c async for c in chunks] for e in chunk.decode().split("\n\n") if e]
    error = json.loads(rest[0].removeprefix("data: "))["error"]
    assert error["code"] == 503 and "drain timeout" in error["message"] and rest[-1] == "data: [DONE]"
    assert untouched(state, D1) and not state.drain.streams


# ---------------------------------------------------------------- the endpoint picker
@pytest.mark.asyncio
async def test_the_picker_learns_a_429_from_the_response_and_answers_429_when_every_decode_is_saturated():
    from disagg.worker.gateway.ext_proc import PickRequest
    from disagg.worker.gateway.picker import RoutingPicker

    _, _, state = router({}, {D1: "ok"}, queue_wait_s=0.1)
    picker = RoutingPicker(state)
    request = PickRequest("POST", "/v1/completions", {}, json.dumps(BODY).encode())
    pick = await picker.pick(request)
    assert pick.status == 200 and pick.decode == "d1:1"
    picker.answered(pick, 429, "3")  # the worker's answer, passed on by the gateway
    picker.done(pick)
    assert untouched(state, D1) and state.decode.endpoints[D1].outstanding == 0
    refused = await picker.pick(request)
    assert refused.status == 429 and refused.retry_after_s == 3 and "capacity" in refused.message


@pytest.mark.asyncio
async def test_past_its_in_flight_bound_the_router_answers_429_at_once_and_serves_again_when_they_end():
    """Before any worker has said it is full (a flood's first second): the router serves at most its bound per
    ready decode worker at once, and answers the rest 429 with Retry-After without sending them anywhere."""
    gate, arrived = asyncio.Event(), []

    async def workers(request: httpx.Request) -> httpx.Response:
        arrived.append(request.url.host)
        await gate.wait()
        return httpx.Response(200, json={"choices": [{"text": "decoded"}]})

    client, state = scripted_router([], [D1, D2], workers, max_in_flight_per_endpoint=2)
    held = [asyncio.ensure_future(client.post("/v1/completions", json=BODY)) for _ in range(4)]  # 2 x 2 ready
    while len(arrived) < 4:
        await asyncio.sleep(0.01)
    r = await asyncio.wait_for(client.post("/v1/completions", json=BODY), 2.0)
    assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
    assert "serves 4 requests, its bound (4)" in r.json()["error"]["message"]
    assert len(arrived) == 4 and metric(state, "disagg:router_requests_total", outcome="shed") == 1
    state.decode.endpoints[D2].ready = False  # one decode worker left: half the bound
    assert (await client.post("/v1/completions", json=BODY)).status_code == 429
    gate.set()
    assert [r.status_code for r in await asyncio.gather(*held)] == [200] * 4
    assert state.in_flight == 0 and untouched(state, D1)
    r = await client.post("/v1/completions", json=BODY)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "decoded"


def test_the_in_flight_bound_is_per_ready_decode_worker_under_a_ceiling_and_zero_leaves_only_the_ceiling():
    _, _, state = router({}, {D1: "ok", D2: "ok"})
    state.max_in_flight_per_endpoint, state.in_flight_ceiling = 3, 5
    assert state.in_flight_bound() == 5
    state.decode.endpoints[D2].ready = False
    assert state.in_flight_bound() == 3
    state.max_in_flight_per_endpoint = 0
    assert state.in_flight_bound() == 5
    state.in_flight_ceiling = None
    assert state.in_flight_bound() is None
