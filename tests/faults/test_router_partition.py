"""A partition between the router and its workers: the router in one network namespace, 1 prefill + 1 decode worker
(SharedStorageConnector) in another, joined by a veth pair whose link the test cuts and restores.

- streams in flight when the link goes down end with an SSE error event (504) within the idle bound - never hang;
- a request sent while the link is down is answered 503/504 within the router's bounds (the workers' probes time
  out: they are taken out and no request waits on them);
- once the link is back the router serves again within a few probe rounds, and the workers abort what the
  router gave up on: nothing left running, KV usage back to 0.

Skipped by name, with the reason, where network namespaces cannot be created here (CI runs as root)."""
from __future__ import annotations

import concurrent.futures
import json
import sys
import time

import httpx
import pytest

from conftest import NetnsClient, wait_idle
from ctl_fixtures import LEASE_S

from disagg.worker.local.process import LocalProcess, ProcessSpec, free_port

pytestmark = pytest.mark.slow

IDLE_S, UNRESPONSIVE_S, CONNECT_S, PROBE_S = 3.0, 2.0, 2.0, 0.5
BOUNDS = ["--connect-timeout", str(CONNECT_S), "--first-byte-timeout", "5", "--idle-timeout", str(IDLE_S),
          "--unresponsive-after", str(UNRESPONSIVE_S), "--probe-interval", str(PROBE_S)]
LONG = 2000
SLACK_S = 10.0


def worker_flags(model: str, kv_dir: str) -> list[str]:
    return ["--host", "0.0.0.0", "--model", model, "--dtype", "float32", "--max-model-len", "2048",
            "--num-kv-blocks", "512", "--served-model-name", "tiny-llama", "--kv-connector", "SharedStorageConnector",
            "--kv-shared-storage-path", kv_dir, "--kv-lease-seconds", str(LEASE_S)]


@pytest.fixture(scope="module")
def split(netns_pair, fault_fleet, tiny_model_dir, tmp_path_factory):
    n = netns_pair
    kv_dir = str(tmp_path_factory.mktemp("kv"))
    prefill = fault_fleet.worker("prefill", worker_flags(tiny_model_dir, kv_dir), netns=n.b, name="prefill-part")
    decode = fault_fleet.worker("decode", worker_flags(tiny_model_dir, kv_dir), netns=n.b, name="decode-part")
    fault_fleet.wait_ready()
    port = free_port()
    base = lambda w: f"http://{n.addr_b}:{w.url.rsplit(':', 1)[1]}"  # noqa: E731
    argv = ["ip", "netns", "exec", n.a, sys.executable, "-m", "disagg.worker.cli", "router", "--host", "127.0.0.1",
            "--port", str(port), "--prefill", base(prefill), "--decode", base(decode), *BOUNDS]
    router = LocalProcess(ProcessSpec("router-part", argv, f"http://127.0.0.1:{port}"), fault_fleet.log_dir)
    router.start()
    client = NetnsClient(n.a)
    url = router.spec.url
    deadline = time.monotonic() + 60
    while not ready(client, url):
        assert router.exited() is None and time.monotonic() < deadline, router.log_tail(30)
        time.sleep(0.2)
    yield {"net": n, "router": router, "url": url, "client": client, "workers": [prefill, decode]}
    n.link(up=True)
    router.terminate()
    assert router.popen.wait(30) == 0, router.log_tail(30)
    client.close()


def ready(client: NetnsClient, url: str) -> bool:
    try:
        return client.request("GET", f"{url}/ready", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def stream_end(client: NetnsClient, url: str, max_tokens: int) -> tuple[str, dict | None]:
    """('whole' | 'error' | 'status <code>', the error) of a streamed request sent from the router's namespace."""
    r = client.request("POST", f"{url}/v1/completions", timeout=60,
                       json={"model": "tiny-llama", "prompt": "the harbour market", "max_tokens": max_tokens,
                             "temperature": 0, "ignore_eos": True, "stream": True})
    if r.status_code != 200:
        return f"status {r.status_code}", r.json().get("error")
    events = [e.removeprefix("data: ") for e in r.text.split("\n\n") if e]
    assert events[-1] == "[DONE]", r.text[-300:]
    errors = [json.loads(e)["error"] for e in events[:-1] if '"error"' in e]
    return ("error", errors[-1]) if errors else ("whole", None)


def test_a_partition_ends_streams_with_an_error_refuses_within_bounds_and_heals(split, record_outcome):
    n, url = split["net"], split["url"]
    assert stream_end(split["client"], url, 8) == ("whole", None)
    streams = [NetnsClient(n.a) for _ in range(2)]
    pool = concurrent.futures.ThreadPoolExecutor(2)
    try:
        futures = [pool.submit(stream_end, c, url, LONG) for c in streams]
        time.sleep(1.0)
        cut = time.monotonic()
        n.link(up=False)
        ends = [f.result(timeout=IDLE_S + SLACK_S) for f in futures]
        took = time.monotonic() - cut
        for kind, error in ends:
            assert kind == "error" and error["code"] == 504 and error["type"] == "timeout", (kind, error)
        record_outcome("router<->workers partition, streams in flight", "SSE error event (504)", took,
                       IDLE_S + SLACK_S)
        time.sleep(UNRESPONSIVE_S + 2 * PROBE_S)  # the probes have timed out long enough: taken out
        sent = time.monotonic()
        kind, error = stream_end(split["client"], url, 8)
        refused_in = time.monotonic() - sent
        assert kind in ("status 503", "status 504") and refused_in < CONNECT_S + SLACK_S, (kind, error)
        record_outcome("router<->workers partition, new request", kind, refused_in, CONNECT_S + SLACK_S)
    finally:
        n.link(up=True)
        pool.shutdown(wait=True)
        for c in streams:
            c.close()
    healed = time.monotonic()
    while stream_end(split["client"], url, 8) != ("whole", None):
        assert time.monotonic() - healed < SLACK_S + 5, "the router did not serve again after the link came back"
        time.sleep(PROBE_S)
    record_outcome("router<->workers partition healed", "200 again", time.monotonic() - healed, SLACK_S + 5)
    wait_idle(split["workers"], timeout=LEASE_S + 30)
