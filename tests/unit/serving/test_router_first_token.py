"""A streamed P/D request's first token goes to the client from the prefill's answer, before the decode hop:
the client has it while the decode worker is still reading the KV; the decode worker is told which tokens
were delivered (kv_transfer_params.delivered_token_ids) and streams what follows. Mock workers
(httpx.MockTransport) whose decode answers only when the test lets it."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from disagg.worker.kv_transfer.handoff import Handoff
from disagg.worker.router.app import build_app
from disagg.worker.router.endpoints import EndpointPool
from disagg.worker.router.hop_bodies import RELEASE_PATH, early_first_chunk
from disagg.worker.router.metrics import RouterMetrics
from disagg.worker.router.state import RouterState

KV = {"do_remote_prefill": True, "remote_engine_id": "e", "remote_block_ids": [1], "remote_host": "h",
      "remote_port": 1, "remote_request_id": "r", "output_token_ids": [42]}
HKV = Handoff.parse(KV)
P1, D1, D2 = "http://p1:1", "http://d1:1", "http://d2:1"


def prefill_answer(chat: bool, kv: dict | None = KV) -> dict:
    c = {"index": 0, "finish_reason": "length",
         **({"message": {"role": "assistant", "content": " hello"}} if chat else {"text": " hello"})}
    return {"id": "cmpl-abc", "object": "chat.completion" if chat else "text_completion", "created": 1700000000,
            "model": "m", "choices": [c], "kv_transfer_params": kv}


class Gate(httpx.AsyncByteStream):
    """A decode stream that starts only when the test opens the gate."""

    def __init__(self, gate: asyncio.Event, chunks: list[bytes]):
        self.gate, self.chunks = gate, chunks

    async def __aiter__(self):
        await self.gate.wait()
        for c in self.chunks:
            yield c


class Workers:
    def __init__(self, decode_mode: dict[str, str], chat: bool = False, kv: dict | None = KV):
        self.decode_mode, self.chat, self.kv = decode_mode, chat, kv
        self.gate = asyncio.Event()
        self.seen: list[tuple[str, dict]] = []
        self.released: list[tuple[str, dict]] = []  # the router's release calls for KV no decode took

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        base = f"{request.url.scheme}://{request.url.host}:{request.url.port}"
        body = json.loads(request.content)
        if request.url.path == RELEASE_PATH:
            self.released.append((base, body))
            return httpx.Response(200, json={"released": True})
        self.seen.append((base, body))
        if base == P1:
            return httpx.Response(200, json=prefill_answer(self.chat, self.kv))
        mode = self.decode_mode[base]
        if mode == "down":
            raise httpx.ConnectError("refused", request=request)
        if mode == "400":
            return httpx.Response(400, json={"error": {"message": "delivered_token_ids: bad", "type": "invalid",
                                                       "code": 400}})
        rest = [b'data: {"choices":[{"index":0,"text":" world","finish_reason":null}]}\n\n', b"data: [DONE]\n\n"]
        return httpx.Response(200, stream=Gate(self.gate, rest), headers={"content-type": "text/event-stream"})


def router(workers: Workers, decodes: list[str], early: bool = True, revisions: dict | None = None):
    pools = []
    for role, urls in (("prefill", [P1]), ("decode", decodes)):
        pool = EndpointPool(role)
        pool.set_urls(urls)
        for ep in pool.endpoints.values():
            ep.ready = True
            ep.revision = (revisions or {}).get(ep.url)
        pools.append(pool)
    state = RouterState(pools[0], pools[1], RouterMetrics("m"), early_first_token=early)
    state.client = httpx.AsyncClient(transport=httpx.MockTransport(workers))
    return httpx.AsyncClient(transport=httpx.ASGITransport(build_app(state)), base_url="http://router"), state


def events(text: str) -> list:
    return [json.loads(line[6:]) if line != "data: [DONE]" else "[DONE]"
            for line in text.splitlines() if line.startswith("data: ")]


def counted(state: RouterState) -> float:
    return state.metrics.early_first_tokens.labels("m", "router")._value.get()


async def asgi_stream(app, path: str, body: dict) -> tuple[asyncio.Task, asyncio.Queue]:
    """Call the ASGI app directly, so that each body part is seen as it is sent (httpx's ASGITransport
    collects the whole response first)."""
    sent: asyncio.Queue = asyncio.Queue()
    raw = json.dumps(body).encode()
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())],
             "client": ("127.0.0.1", 1), "server": ("router", 80)}
    messages = [{"type": "http.request", "body": raw, "more_body": False}]

    async def receive():
        if messages:
            return messages.pop(0)
        await asyncio.Event().wait()  # no disconnect

    return asyncio.ensure_future(app(scope, receive, sent.put)), sent


async def next_body(sent: asyncio.Queue) -> bytes:
    while True:
        m = await asyncio.wait_for(sent.get(), 5)
        if m["type"] == "http.response.start":
            assert m["status"] == 200
        elif m.get("body"):
            return m["body"]
        elif not m.get("more_body"):
            return b""


@pytest.mark.asyncio
@pytest.mark.parametrize("chat", [False, True])
async def test_the_first_chunk_arrives_before_the_decode_answers(chat):
    workers = Workers({D1: "ok"}, chat=chat)
    client, state = router(workers, [D1])
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = {"max_tokens": 8, "stream": True, **({"messages": [{"role": "user", "content": "x"}]} if chat
                                                 else {"prompt": "x"})}
    app = client._transport.app
    task, sent = await asgi_stream(app, path, body)
    (chunk,) = events((await next_body(sent)).decode())  # the decode's gate is still shut
    assert (chunk["id"], chunk["created"], chunk["model"]) == ("cmpl-abc", 1700000000, "m")
    if chat:
        assert chunk["object"] == "chat.completion.chunk"
        assert chunk["choices"][0]["delta"] == {"role": "assistant", "content": " hello"}
    else:
        assert chunk["object"] == "text_completion" and chunk["choices"][0]["text"] == " hello"
    assert chunk["choices"][0]["finish_reason"] is None
    workers.gate.set()
    rest = b""
    while part := await next_body(sent):
        rest += part
    await task
    assert events(rest.decode()) == [{"choices": [{"index": 0, "text": " world", "finish_reason": None}]}, "[DONE]"]
    (_, p_body), (d_url, d_body) = workers.seen
    assert p_body["max_tokens"] == 1 and d_url == D1 and d_body["max_tokens"] == 8
    assert d_body["kv_transfer_params"] == {**KV, "delivered_token_ids": [42]}
    assert counted(state) == 1


@pytest.mark.asyncio
@pytest.mark.parametrize("extra", [
    {"stream": False}, {"logprobs": 2}, {"n": 2}, {"echo": True}, {"stop": ["\n"]}, {"stop": "."},
    {"stream_options": {"include_usage": True, "continuous_usage_stats": True}},
])
async def test_what_the_one_token_answer_cannot_stand_for_streams_from_the_decode(extra):
    workers = Workers({D1: "ok"})
    workers.gate.set()
    client, state = router(workers, [D1])
    r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 8, "stream": True, **extra})
    assert r.status_code == 200
    (_, d_body) = workers.seen[-1]
    assert "delivered_token_ids" not in d_body["kv_transfer_params"]
    assert counted(state) == 0


@pytest.mark.asyncio
async def test_a_prefill_that_does_not_say_its_token_vllm_streams_from_the_decode():
    workers = Workers({D1: "ok"}, kv={k: v for k, v in KV.items() if k != "output_token_ids"})
    workers.gate.set()
    client, state = router(workers, [D1])
    r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 8, "stream": True})
    assert r.status_code == 200 and "delivered_token_ids" not in workers.seen[-1][1]["kv_transfer_params"]
    assert counted(state) == 0


@pytest.mark.asyncio
async def test_switched_off_the_decode_streams_every_token():
    workers = Workers({D1: "ok"})
    workers.gate.set()
    client, state = router(workers, [D1], early=False)
    r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 8, "stream": True})
    assert [e for e in events(r.text) if e != "[DONE]"][0]["choices"][0]["text"] == " world"
    assert "delivered_token_ids" not in workers.seen[-1][1]["kv_transfer_params"]


@pytest.mark.asyncio
async def test_a_decode_hop_failing_after_the_first_token_ends_the_stream_with_an_error_event():
    workers = Workers({D1: "down", D2: "down"})
    client, state = router(workers, [D1, D2])
    r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 8, "stream": True})
    assert r.status_code == 200  # sent with the first token
    got = events(r.text)
    assert got[0]["choices"][0]["text"] == " hello" and got[-1] == "[DONE]"
    assert got[-2]["error"]["code"] == 503 and "no decode endpoint available" in got[-2]["error"]["message"]
    assert [u for u, _ in workers.seen[1:]] in ([D1, D2], [D2, D1])  # both tried before giving up


@pytest.mark.asyncio
async def test_a_decode_rejecting_the_continuation_is_reported_in_the_stream():
    workers = Workers({D1: "400"})
    client, _ = router(workers, [D1])
    r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 8, "stream": True})
    got = events(r.text)
    assert got[-2]["error"]["code"] == 400 and "delivered_token_ids: bad" in got[-2]["error"]["message"]


@pytest.mark.asyncio
async def test_decoding_alone_on_another_revision_still_continues_after_the_delivered_token():
    workers = Workers({D1: "ok"})
    workers.gate.set()
    client, _ = router(workers, [D1], revisions={D1: "new"})  # the prefill (revision None) has no decode left
    r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 8, "stream": True})
    assert r.status_code == 200
    assert workers.seen[-1][1]["kv_transfer_params"] == {"delivered_token_ids": [42]}  # no KV across revisions
    for _ in range(100):  # the release goes out in the background once the request is over
        if workers.released:
            break
        await asyncio.sleep(0.01)
    # nobody will read the prefill's KV: its prefill is asked to free it now, with the hand-off it gave
    assert [(url, body["kv_transfer_params"]["remote_block_ids"]) for url, body in workers.released] == [(P1, [1])]


def test_the_first_chunk_needs_the_prefills_text():
    assert early_first_chunk({"stream": True}, "/v1/completions", {"choices": []}, HKV) is None
    assert early_first_chunk({"stream": True}, "/v1/completions", prefill_answer(False), None) is None
    two = {**KV, "output_token_ids": [1, 2]}
    assert early_first_chunk({"stream": True}, "/v1/completions", prefill_answer(False), Handoff.parse(two)) is None


def test_a_first_token_that_is_part_of_a_character_streams_from_the_decode():
    """A byte-level token can be the first bytes of a UTF-8 character: alone it decodes to U+FFFD, which a stream
    holds back until the next tokens complete the character. Sent early it showed up twice (seen through disagg
    up: the stream read '\ufffd\ufffd into ...' where the full answer read '\ufffd into ...')."""
    partial = prefill_answer(False)
    partial["choices"][0]["text"] = "\ufffd"
    assert early_first_chunk({"stream": True}, "/v1/completions", partial, HKV) is None
    chat = prefill_answer(True)
    chat["choices"][0]["message"]["content"] = "ab\ufffd"
    assert early_first_chunk({"stream": True}, "/v1/chat/completions", chat, HKV) is None
    assert early_first_chunk({"stream": True}, "/v1/completions", prefill_answer(False), HKV) is not None
