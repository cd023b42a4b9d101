"""Router + 1 prefill + 2 decode workers (one hand-off key: every hand-off signed and checked) + a colocated
reference worker, as processes on loopback, once per KV connector: greedy parity, bad input, 32 concurrent requests leaving no KV held, a decode worker killed
mid-stream, and SIGTERM drains with exit status 0."""
from __future__ import annotations

import asyncio
import json
import signal
import time

import httpx
import pytest
from serving_fleet import signal_group
from serving_helpers import metric

pytestmark = pytest.mark.slow

LONG_PROMPT = ("The history of the city begins with a small harbour and a market where fishermen sold the morning "
               "catch to merchants from the hills")


def complete(url: str, body: dict, **kw) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json={"model": "tiny-llama", **body}, timeout=60, **kw)


def test_pd_greedy_output_matches_the_colocated_worker_and_moves_kv(pd):
    body = {"prompt": LONG_PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    want = complete(pd["reference"], body).json()["choices"][0]["text"]
    r = complete(pd["router"], body, headers={"X-Request-Id": "parity-1"})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == want
    assert r.headers["x-request-id"] == "parity-1"
    assert sum(metric(u, "disagg:kv_bytes_loaded_total") for u in pd["decodes"]) > 0, "no KV reached decode"


@pytest.mark.parametrize("body, status, needle", [
    (b'{"prompt": "x",', 400, "malformed JSON"),
    ({"prompt": "x", "model": "gpt-17"}, 404, "does not exist"),
    ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "word " * 600, "max_tokens": 4}, 400, "max_model_len"),
    ({"prompt": "x", "temperature": -1}, 400, "temperature"),
    ({"prompt": "x", "kv_transfer_params": {"do_remote_prefill": True, "remote_block_ids": "x"}}, 400,
     "kv_transfer_params.remote_engine_id"),
    ({"prompt": "x", "kv_transfer_params": "yes"}, 400, "kv_transfer_params"),
    ({"prompt": "x", "kv_transfer_params": {"delivered_token_ids": [-1]}}, 400, "delivered_token_ids"),
    ({"prompt": "x", "max_tokens": 1, "kv_transfer_params": {"delivered_token_ids": [1, 2]}}, 400,
     "more than max_tokens"),
])
def test_bad_input_gets_openai_error_json_and_serving_continues(pd, body, status, needle):
    # through the router, and (kv_transfer_params is the router's own field) at a decode worker directly
    for url in (pd["router"], pd["decodes"][1]):
        if isinstance(body, dict) and "kv_transfer_params" in body and url == pd["router"]:
            continue
        kw = {"content": body} if isinstance(body, bytes) else {"json": body}
        r = httpx.post(f"{url}/v1/completions", timeout=30, **kw)
        assert r.status_code == status, (url, r.text)
        error = r.json()["error"]
        assert needle in error["message"] and error["code"] == status and error["type"]
    ok = complete(pd["router"], {"prompt": "still serving", "max_tokens": 2})
    assert ok.status_code == 200


async def _one(client: httpx.AsyncClient, url: str, i: int) -> tuple[int, str]:
    body = {"model": "tiny-llama", "prompt": f"{LONG_PROMPT} number {i}", "max_tokens": 8, "temperature": 0,
            "ignore_eos": True, "stream": i % 2 == 0}
    path = "/v1/completions"
    if i % 3 == 0:
        body = {**{k: v for k, v in body.items() if k != "prompt"},
                "messages": [{"role": "user", "content": f"question {i}: {LONG_PROMPT}"}]}
        path = "/v1/chat/completions"
    r = await client.post(url + path, json=body, timeout=120)
    return r.status_code, r.text


def test_32_concurrent_requests_complete_and_leave_no_kv_held(pd):
    async def run() -> list[tuple[int, str]]:
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=64)) as client:
            return await asyncio.gather(*(_one(client, pd["router"], i) for i in range(32)))

    results = asyncio.run(run())
    assert [s for s, _ in results] == [200] * 32, [t for s, t in results if s != 200][:2]
    assert all(t.rstrip().endswith("data: [DONE]") for i, (_, t) in enumerate(results) if i % 2 == 0)
    workers = [pd["prefill"], *pd["decodes"]]
    deadline = time.monotonic() + 30
    while True:
        held = {u: (metric(u, "vllm:kv_cache_usage_perc"), metric(u, "disagg:kv_pending_sends"),
                    metric(u, "vllm:num_requests_running")) for u in workers}
        if all(v == (0.0, 0.0, 0.0) for v in held.values()):
            break
        assert time.monotonic() < deadline, f"KV still held: {held}"
        time.sleep(0.2)
    assert metric(pd["prefill"], "vllm:time_to_first_token_seconds_count") >= 32


def streaming_decode(router: str) -> str | None:
    """The decode endpoint the router is relaying a stream from (its one outstanding request), or None."""
    busy = [e["url"] for e in httpx.get(f"{router}/endpoints", timeout=10).json()["decode"] if e["outstanding"]]
    return busy[0] if len(busy) == 1 else None


def test_decode_killed_mid_stream_gives_a_clean_error_and_serving_continues(pd):
    body = {"model": "tiny-llama", "prompt": LONG_PROMPT, "max_tokens": 400, "temperature": 0, "ignore_eos": True,
            "stream": True}
    decodes = {p.spec.url: p for name, p in pd["fleet"].procs.items() if name.startswith("decode")}
    for attempt in range(3):
        events: list[str] = []
        with httpx.stream("POST", f"{pd['router']}/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            lines = (line for line in r.iter_lines() if line.startswith("data:"))
            # the first token comes from the prefill's answer, the second from the decode worker: then freeze both
            # decodes, so that the stream cannot finish (400 tokens take ~1 s) while the test finds which one it is
            events += [next(lines), next(lines)]
            for p in decodes.values():
                signal_group(p, signal.SIGSTOP)
            try:
                victim = streaming_decode(pd["router"])
                if victim is not None:
                    decodes[victim].kill()
                    pd["fleet"].killed.add(decodes[victim].spec.name)
            finally:
                for p in decodes.values():
                    signal_group(p, signal.SIGCONT)
            events += list(lines)
        if victim is not None:
            break
        print(f"attempt {attempt}: the stream had ended before both decodes were frozen")  # a starved test process
    assert victim is not None, "the stream ended each time before the test could freeze the decode workers"
    assert json.loads(events[-2][len("data: "):]).get("error", {}).get("code") == 502, (victim, events[-3:])
    assert events[-1] == "data: [DONE]"
    # the router (retrying on the surviving decode) and the prefill keep serving
    for i in range(4):
        r = complete(pd["router"], {"prompt": f"after the crash {i}", "max_tokens": 3})
        assert r.status_code == 200, r.text
    deadline = time.monotonic() + 15  # the prefill's lease is 3 s
    while metric(pd["prefill"], "disagg:kv_pending_sends") or metric(pd["prefill"], "vllm:kv_cache_usage_perc"):
        assert time.monotonic() < deadline, "the prefill still holds KV blocks"
        time.sleep(0.2)


def early_first_tokens(router: str) -> float:
    """The router's count of first tokens streamed from the prefill's answer (not rendered before the first)."""
    lines = httpx.get(f"{router}/metrics", timeout=5).text.splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith("disagg:router_early_first_tokens_total{"))


def streamed(url: str, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{url}{path}", json={"model": "tiny-llama", **body}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        data = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.9, "top_p": 0.95, "seed": 11}],
                         ids=["greedy", "seeded"])
def test_a_streamed_pd_answer_starts_from_the_prefills_token_and_equals_the_colocated_one(pd, chat, sampling):
    """The router sends the prefill's token first; the decode worker continues after it (its sampler still
    draws for that position, so a seeded request's later tokens are the colocated worker's too)."""
    path = "/v1/chat/completions" if chat else "/v1/completions"
    prompt = {"messages": [{"role": "user", "content": LONG_PROMPT}]} if chat else {"prompt": LONG_PROMPT}
    body = {**prompt, "max_tokens": 10, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}, **sampling}
    want = streamed(pd["reference"], path, body)
    before = early_first_tokens(pd["router"])
    got = streamed(pd["router"], path, body)
    assert early_first_tokens(pd["router"]) == before + 1

    def text(chunks: list[dict]) -> str:
        return "".join((c["choices"][0]["delta"].get("content") or "") if chat else c["choices"][0]["text"]
                       for c in chunks if c["choices"])

    assert text(got) == text(want) and text(got)
    assert got[-1]["usage"] == want[-1]["usage"] and got[-1]["usage"]["completion_tokens"] == 10
    assert len({c["id"] for c in got}) == 1  # the router's first chunk and the decode's carry one id
    assert [c["choices"][0]["finish_reason"] for c in got if c["choices"]][-1] == "length"
    if chat:
        assert [c["choices"][0]["delta"].get("role") for c in got if c["choices"]].count("assistant") == 1


def test_a_streamed_request_of_one_token_finishes_after_the_prefills_token(pd):
    body = {"prompt": LONG_PROMPT, "max_tokens": 1, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    want = complete(pd["reference"], {**body, "stream": False}).json()
    got = streamed(pd["router"], "/v1/completions", body)
    assert "".join(c["choices"][0]["text"] for c in got if c["choices"]) == want["choices"][0]["text"]
    assert [c["choices"][0]["finish_reason"] for c in got if c["choices"]] == [None, "length"]
    assert got[-1]["usage"]["completion_tokens"] == 1


def test_streamed_pd_text_equals_the_whole_answer_when_tokens_split_characters(pd):
    """Byte-level tokens of a random model often end mid-character (their text alone is U+FFFD): a stream holds
    such text back until the character completes. Over many prompts, some first tokens are such bytes; the
    streamed P/D text must still be exactly the colocated worker's whole answer."""
    words = LONG_PROMPT.split()
    prompts = [" ".join(words[i % len(words):] + words[:i % 7]) for i in range(24)]
    split_first = 0
    for prompt in prompts:
        body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        want = complete(pd["reference"], body).json()["choices"][0]["text"]
        got = streamed(pd["router"], "/v1/completions", {**body, "stream": True})
        assert "".join(c["choices"][0]["text"] for c in got if c["choices"]) == want, prompt
        split_first += want.startswith("\ufffd")
    print(f"{split_first} of {len(prompts)} answers start with a split character")
