"""Hung workers (SIGSTOP of the whole process, as a frozen node or a partition looks) behind a real router:
2 prefill + 2 decode workers (SharedStorageConnector) and the router with short bounds, on loopback.

- a frozen prefill: requests complete through the other prefill, then through decode alone when both are frozen,
  each within its bound and with the healthy run's tokens; the frozen one is ejected and used again once thawed;
- a frozen decode: requests move to the other decode before anything streamed (a non-streamed one once the frozen
  worker's probes time out); with both frozen a stream gets the prefill's first token and then an SSE error event
  (504) within the first-byte bound, then (503) at once while both are out; thawed, both serve again. A router
  with --no-early-first-token answers such a stream with a 504 JSON error before anything streamed;
- afterwards nothing is left on any worker (no running requests, no pending KV, KV usage idle)."""
from __future__ import annotations

import json
import time

import httpx
import pytest
from waiting import wait_for

from ctl_fixtures import Fleet, frozen, gauges, router_counter, wait_idle

pytestmark = pytest.mark.slow

FIRST_BYTE_S, IDLE_S, TOTAL_S = 5.0, 5.0, 60.0
BOUNDS = ["--connect-timeout", "2", "--first-byte-timeout", str(FIRST_BYTE_S), "--idle-timeout", str(IDLE_S),
          "--request-timeout", str(TOTAL_S), "--eject-after-failures", "2", "--ejection-seconds", "3",
          "--max-ejection-seconds", "12"]
PROBE_INTERVAL_S = 1.0  # probe timeout 2 s
PROBES_S = 8.0 + 2.0  # the router's default --unresponsive-after, and the probe that finds it
# a healthy request on top of a bound: under 1 s on an idle machine, many seconds on a shared 2-core one
SLACK_S = 15.0
BODY = {"model": "tiny-llama", "prompt": "The harbour market opened before dawn and the fishermen", "max_tokens": 8,
        "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def pd(tiny_model_dir, tmp_path_factory):
    fleet = Fleet(tmp_path_factory.mktemp("hung-workers"))
    prefill = [fleet.worker(f"prefill-{i}", "prefill", tiny_model_dir) for i in range(2)]
    decode = [fleet.worker(f"decode-{i}", "decode", tiny_model_dir) for i in range(2)]
    fleet.wait_ready()
    router = fleet.router(prefill, decode, BOUNDS + ["--probe-interval", str(PROBE_INTERVAL_S)])
    late = fleet.router(prefill, decode, BOUNDS + ["--probe-interval", str(PROBE_INTERVAL_S), "--no-early-first-token"],
                        name="router-late")
    fleet.wait_ready()
    healthy = {s: text(post(router, stream=s)) for s in (False, True)}
    assert healthy[False] == healthy[True] == text(post(late, stream=True)) and healthy[False]
    yield {"fleet": fleet, "router": router, "late": late, "prefill": prefill, "decode": decode,
           "want": healthy[False]}
    codes = fleet.stop()
    assert codes == dict.fromkeys(codes, 0), codes


def post(router: str, stream: bool = False) -> httpx.Response:
    return httpx.post(f"{router}/v1/completions", json={**BODY, "stream": stream}, timeout=TOTAL_S + 30)


def sse_events(r: httpx.Response) -> list:
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"), r.text
    events = [e.removeprefix("data: ") for e in r.text.split("\n\n") if e]
    assert events[-1] == "[DONE]", r.text
    return [json.loads(e) for e in events[:-1]]


def text(r: httpx.Response) -> str:
    assert r.status_code == 200, r.text
    if r.headers["content-type"].startswith("text/event-stream"):
        events = [e.removeprefix("data: ") for e in r.text.split("\n\n") if e]
        assert events[-1] == "[DONE]" and '"error"' not in r.text, r.text
        return "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
    return r.json()["choices"][0]["text"]


def endpoint(router: str, role: str, url: str) -> dict:
    return next(e for e in httpx.get(f"{router}/endpoints", timeout=5).json()[role] if e["url"] == url)


def timeouts(router: str, hop: str) -> float:
    return router_counter(router, "disagg:router_hop_timeouts_total", hop=hop)


def timed(fn, *args, **kw) -> tuple[httpx.Response, float]:
    t0 = time.monotonic()
    r = fn(*args, **kw)
    return r, time.monotonic() - t0


def router_sees_idle(router: str, role: str, urls: tuple[str, ...]) -> None:
    """The router's view of these endpoints is idle: ready, not ejected, no load and no KV in use by their
    last /metrics - so ties rotate and each is chosen in turn (a request a frozen worker got from a client that
    gave up runs once it is thawed, and its scraped load would steer every request to the other)."""
    wait_idle(list(urls))

    def idle() -> bool:
        eps = [endpoint(router, role, u) for u in urls]
        return all(e["ready"] and not e["ejected"] and e["load"] == 0 and e["kv_usage"] == 0 for e in eps)
    wait_for(idle, 30, f"the router sees {role} {urls} idle")


def served(url: str) -> float:
    return router_counter(url, "vllm:request_success_total")


def test_frozen_prefill_fails_over_to_the_other_then_to_decode_alone_and_comes_back(pd):
    router, (p0, p1) = pd["router"], pd["prefill"]
    fleet = pd["fleet"]
    before = timeouts(router, "prefill")
    with frozen(fleet.procs["prefill-0"]):
        for _ in range(3):  # round-robin among ties: one of the first requests goes to the frozen one
            r, took = timed(post, router)
            assert text(r) == pd["want"] and took < FIRST_BYTE_S + SLACK_S
            if timeouts(router, "prefill") > before:
                print(f"OUTCOME prefill frozen -> completed via the other prefill in {took:.1f} s")
                break
        assert timeouts(router, "prefill") == before + 1, "the frozen prefill was never tried"
        assert endpoint(router, "prefill", p0)["ejections"] >= 1, "ejected (maybe over already: it still fails "
        "its probes)"
        for _ in range(3):  # left out: no request waits on it again
            r, took = timed(post, router, stream=True)
            assert text(r) == pd["want"] and took < SLACK_S
        assert timeouts(router, "prefill") == before + 1

        alone = router_counter(router, "disagg:router_decode_alone_total")
        with frozen(fleet.procs["prefill-1"]):  # no prefill answers: the decode worker computes the prompt
            r, took = timed(post, router)
            assert text(r) == pd["want"] and took < FIRST_BYTE_S + SLACK_S
            assert router_counter(router, "disagg:router_decode_alone_total") == alone + 1
            print(f"OUTCOME both prefills frozen -> completed by decode alone in {took:.1f} s")
    # thawed: probes pass again and the ejection runs out; it serves again
    thawed = time.monotonic()
    wait_for(lambda: all(endpoint(router, "prefill", u)["ready"] and not endpoint(router, "prefill", u)["ejected"]
                         for u in (p0, p1)), 30, "both prefills back")
    print(f"OUTCOME prefills thawed -> restored in {time.monotonic() - thawed:.1f} s")
    router_sees_idle(router, "prefill", (p0, p1))
    start = served(p0)
    for _ in range(4):
        assert text(post(router)) == pd["want"]
    assert served(p0) > start, "the thawed prefill is chosen again"
    wait_idle([*pd["prefill"], *pd["decode"]])


def test_frozen_decode_moves_to_the_other_then_both_frozen_is_a_504_before_anything_streamed(pd):
    router, (d0, d1) = pd["router"], pd["decode"]
    fleet = pd["fleet"]
    before = timeouts(router, "decode")
    unresponsive = router_counter(router, "disagg:router_hop_timeouts_total", hop="decode", stage="unresponsive")
    with frozen(fleet.procs["decode-0"]):
        # not streamed: no first byte before the answer, so the frozen one's probes tell. Least-loaded may send
        # every request to the other decode (the frozen one's last scraped load is stale and may be higher), so
        # keep asking until one request waited on it or its probes took it out - within the probes' bound
        deadline = time.monotonic() + PROBES_S + SLACK_S
        waited = False
        while True:
            r, took = timed(post, router)
            assert text(r) == pd["want"] and took < PROBES_S + SLACK_S
            waited = timeouts(router, "decode") > before
            if waited:
                print(f"OUTCOME decode frozen, not streamed -> completed via the other decode in {took:.1f} s")
                break
            if not endpoint(router, "decode", d0)["ready"]:
                print("OUTCOME decode frozen, not streamed -> left out by its probes before any request waited "
                      "on it")
                break
            assert time.monotonic() < deadline, "the frozen decode was neither tried nor left out by its probes"
            time.sleep(0.5)
        if waited:  # a request waited on it: abandoned once its probes timed out
            assert router_counter(router, "disagg:router_hop_timeouts_total", hop="decode",
                                  stage="unresponsive") == unresponsive + 1
            assert timeouts(router, "decode") == before + 1
            assert endpoint(router, "decode", d0)["ejections"] >= 1
        else:  # left out: no request waits on it again
            r, took = timed(post, router)
            assert text(r) == pd["want"] and took < SLACK_S and timeouts(router, "decode") == before
        with frozen(fleet.procs["decode-1"]):
            # the prefill's token is streamed at once; the decode hop then runs past its bound
            r, took = timed(post, router, stream=True)
            first, *_, last = sse_events(r)
            assert pd["want"].startswith(first["choices"][0]["text"]) and first["choices"][0]["text"]
            error = last["error"]
            assert error["code"] == 504 and error["type"] == "timeout" and d1 in error["message"], error
            assert FIRST_BYTE_S - 0.5 < took < FIRST_BYTE_S + SLACK_S
            print(f"OUTCOME both decodes frozen -> first token, then an SSE error (504) in {took:.1f} s")
            # both are out now (ejected, probes timing out): the next client is told at once
            r, took = timed(post, router, stream=True)
            error = sse_events(r)[-1]["error"]
            assert error["code"] == 503 and error["type"] == "service_unavailable" and took < 3.0, error
            print(f"OUTCOME both decodes out -> first token, then an SSE error (503) in {took:.2f} s")
    assert router_counter(router, "disagg:router_requests_total", outcome="timeout") >= 1
    wait_for(lambda: all(endpoint(router, "decode", u)["ready"] and not endpoint(router, "decode", u)["ejected"]
                         for u in (d0, d1)), 30, "both decodes back")
    late = pd["late"]
    with frozen(fleet.procs["decode-0"], fleet.procs["decode-1"]):  # the first token from the decode worker
        r, took = timed(post, late, stream=True)
        assert r.status_code == 504 and r.headers["content-type"] == "application/json", r.text
        error = r.json()["error"]
        assert error["type"] == "timeout" and (d0 in error["message"] or d1 in error["message"])
        assert FIRST_BYTE_S - 0.5 < took < 2 * FIRST_BYTE_S + SLACK_S  # each decode tried once
        print(f"OUTCOME both decodes frozen, router --no-early-first-token -> 504 in {took:.1f} s")
    thawed = time.monotonic()
    wait_for(lambda: all(endpoint(router, "decode", u)["ready"] and not endpoint(router, "decode", u)["ejected"]
                         for u in (d0, d1)), 30, "both decodes back")
    print(f"OUTCOME decodes thawed -> restored in {time.monotonic() - thawed:.1f} s")
    router_sees_idle(router, "decode", (d0, d1))
    start = served(d0)
    for stream in (False, True, False, True):
        assert text(post(router, stream=stream)) == pd["want"]
    assert served(d0) > start, "the thawed decode is chosen again"
    wait_idle([*pd["prefill"], *pd["decode"]])
    assert all(gauges(u)["vllm:num_requests_running"] == 0 for u in pd["decode"])
