"""P/D behind a real Envoy configured as a GIE gateway, with `disagg epp` picking: 1 prefill + 2 decode workers
(NIXL), the router beside them for comparison. Each answer through the gateway equals the router path's (greedy),
the KV moves over NIXL, the decode side runs the prefill hop, bad input gets the router's 4xx, a client cannot
point a worker at a host, a prefill that dies leaves decode-alone serving, and every process exits 0."""
from __future__ import annotations

import json

import httpx
import pytest
from serving_fleet import Fleet
from serving_helpers import NIXL_MISSING, metric, nixl_available

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not nixl_available(), reason=NIXL_MISSING)]

PROMPT = "The harbour of the old town was busy with fishermen and merchants selling the morning catch"
# each case its own prompt: a decode worker that cached a prompt's blocks reads none of them again
BODIES = {
    "completion": ("/v1/completions", {"prompt": f"{PROMPT} (1)", "max_tokens": 10, "temperature": 0,
                                       "ignore_eos": True}),
    "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": f"{PROMPT} (2)"}], "max_tokens": 10,
                                      "temperature": 0, "ignore_eos": True}),
    "n": ("/v1/completions", {"prompt": f"{PROMPT} (3)", "max_tokens": 6, "temperature": 0.8, "seed": 7, "n": 3}),
    "logprobs": ("/v1/completions", {"prompt": f"{PROMPT} (4)", "max_tokens": 5, "temperature": 0, "logprobs": 2}),
}


@pytest.fixture(scope="module")
def gw(tiny_model_dir, tmp_path_factory):
    fleet = Fleet(tmp_path_factory.mktemp("gateway-pd"))
    prefill = fleet.worker("prefill", "prefill", tiny_model_dir, "NixlConnector", lease_s=5)
    decodes = [fleet.worker(f"decode-{i}", "decode", tiny_model_dir, "NixlConnector",
                            extra=("--pd-discovery", "static", "--pd-prefill", prefill, "--pd-probe-interval", "0.5"))
               for i in range(2)]
    fleet.wait_ready()
    picker = fleet.epp([prefill], decodes)
    gateway = fleet.envoy(picker, decodes)
    router = fleet.router([prefill], decodes)
    fleet.wait_ready()
    yield {"fleet": fleet, "gateway": gateway, "router": router, "prefill": prefill, "decodes": decodes}
    codes = fleet.stop()
    assert {n: c for n, c in codes.items() if n not in fleet.killed} == \
        {n: 0 for n in codes if n not in fleet.killed}


def post(url: str, path: str, body: dict, **kw) -> httpx.Response:
    return httpx.post(f"{url}{path}", json={"model": "tiny-llama", **body}, timeout=60, **kw)


def answer(r: httpx.Response) -> list:
    assert r.status_code == 200, r.text
    out = []
    for c in r.json()["choices"]:
        text = c["message"]["content"] if "message" in c else c["text"]
        out.append((c["index"], text, json.dumps(c.get("logprobs"), sort_keys=True)))
    return out


def pending_sends(urls: list[str]) -> float:
    """The hand-offs the decode side's prefill hops see pending at the prefill, over these decode workers."""
    samples = [float(line.rsplit(" ", 1)[1]) for u in urls for line in httpx.get(f"{u}/metrics", timeout=5).text
               .splitlines() if line.startswith("disagg:router_kv_pending_sends{")]
    assert len(samples) == len(urls), "each decode worker's page has its hop's view of the one prefill"
    return sum(samples)


def nixl_reads(urls: list[str]) -> float:
    return sum(metric(u, "vllm:nixl_xfer_time_seconds_count") for u in urls)


@pytest.mark.parametrize("case", sorted(BODIES))
def test_answers_through_the_gateway_equal_the_routers_and_the_kv_moves(gw, case):
    path, body = BODIES[case]
    before = nixl_reads(gw["decodes"])
    via_gateway = answer(post(gw["gateway"], path, body))
    assert nixl_reads(gw["decodes"]) > before, "no KV was read over NIXL for the gateway's request"
    # the decode side's hop measured the hand-off as the router does: no longer pending once the decode took it
    assert pending_sends(gw["decodes"]) == 0
    assert via_gateway == answer(post(gw["router"], path, body))


def test_a_stream_through_the_gateway_starts_with_the_prefills_token_and_equals_the_routers(gw):
    path, body = "/v1/completions", {**BODIES["completion"][1], "prompt": f"{PROMPT} (stream)"}
    before = sum(metric(u, "disagg:router_early_first_tokens_total", 0) for u in gw["decodes"])

    def streamed(url: str) -> str:
        with httpx.stream("POST", f"{url}{path}", json={"model": "tiny-llama", **body, "stream": True},
                          timeout=60) as r:
            assert r.status_code == 200
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        return "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])

    assert streamed(gw["gateway"]) == streamed(gw["router"]) == answer(post(gw["router"], path, body))[0][1]
    assert sum(metric(u, "disagg:router_early_first_tokens_total", 0) for u in gw["decodes"]) == before + 1


@pytest.mark.parametrize("body, status, needle", [
    (b'{"prompt": "x",', 400, "malformed JSON"),
    ({"prompt": "x", "model": "gpt-17"}, 404, "does not exist"),
    ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "x", "temperature": -1}, 400, "temperature"),
    ({"prompt": "x", "best_of": 2}, 400, "best_of"),
])
def test_bad_input_gets_the_same_4xx_as_through_the_router(gw, body, status, needle):
    answers = []
    for url in (gw["gateway"], gw["router"]):
        kw = {"content": body} if isinstance(body, bytes) else {"json": {"model": "tiny-llama", **body}}
        r = httpx.post(f"{url}/v1/completions", timeout=30, **kw)
        assert r.status_code == status and needle in r.json()["error"]["message"], (url, r.text)
        answers.append((r.status_code, r.json()["error"]["param"]))
    assert answers[0] == answers[1]


def test_a_client_cannot_point_a_worker_at_a_host(gw):
    """Through the gateway a client's x-prefiller-host-port never arrives (the picker names the prefill); sent to
    a decode worker directly, it names no prefill endpoint of the pool: refused, never contacted."""
    import socket
    import threading

    trap = socket.socket()
    trap.bind(("127.0.0.77", 0))
    trap.listen()
    trap.settimeout(0.2)
    seen: list = []

    def watch() -> None:
        while not stop.is_set():
            try:
                seen.append(trap.accept())
            except OSError:
                pass

    stop = threading.Event()
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    evil = f"127.0.0.77:{trap.getsockname()[1]}"
    path, body = BODIES["completion"]
    refused_before = sum(metric(u, "disagg:router_refused_prefill_targets_total", 0) for u in gw["decodes"])
    try:
        via_gateway = post(gw["gateway"], path, body, headers={"x-prefiller-host-port": evil})
        direct = post(gw["decodes"][0], path, body, headers={"x-prefiller-host-port": evil})
    finally:
        stop.set()
        watcher.join(2)
        trap.close()
    assert seen == []
    assert answer(via_gateway) == answer(direct) == answer(post(gw["router"], path, body))
    assert sum(metric(u, "disagg:router_refused_prefill_targets_total", 0) for u in gw["decodes"]) == refused_before + 1


def test_with_the_prefill_gone_the_gateway_still_serves_decode_alone(gw):
    """Last in this module: the prefill worker is killed; the decode side's hop fails over to decoding alone."""
    path, body = BODIES["completion"]
    want = answer(post(gw["router"], path, body))
    fleet: Fleet = gw["fleet"]
    fleet.procs["prefill"].kill()
    fleet.killed.add("prefill")
    assert answer(post(gw["gateway"], path, body)) == want
