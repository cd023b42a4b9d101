"""`disagg up` with spec.autoscaling.scaleToZero: idle for idleSeconds, both pools go to zero processes; then 20
concurrent requests arrive: the router holds them, the launcher brings prefill and decode back at once (it reads
the router's held count every half second at zero), and every request gets 200 with the warm run's greedy text.
The cold start (held -> first token) is read from the router's histogram and printed. A request no decode comes
for within holdSeconds gets 503 with Retry-After, not a hang."""
from __future__ import annotations

import concurrent.futures
import json
import signal
import subprocess
import time

import httpx
import pytest
from serving_helpers import metric, nixl_available

from disagg.worker.local.process import free_port
from test_disagg_up import CLI, REPO, alive, children_of, wait_for
from test_disagg_up_autoscaling import disagg_up

pytestmark = pytest.mark.slow

PROMPT = "The quick brown fox jumps over the lazy dog"
SPEC = {
    "apiVersion": "disagg.dev/v1alpha1", "kind": "DisaggregatedInference", "metadata": {"name": "zero"},
    "spec": {
        "model": {"servedName": "tiny-llama", "dtype": "float32", "maxModelLen": 512},
        "kvTransfer": {"connector": "NixlConnector" if nixl_available() else "SharedStorageConnector",
                       "leaseSeconds": 5},
        "prefill": {"replicas": 1}, "decode": {"replicas": 1},
        "autoscaling": {
            "enabled": True, "intervalSeconds": 1,
            "prefill": {"minReplicas": 1, "maxReplicas": 1}, "decode": {"minReplicas": 1, "maxReplicas": 1},
            "scaleToZero": {"enabled": True, "idleSeconds": 3, "holdSeconds": 90, "maxHeldRequests": 50},
        },
    },
}


def complete(router: str) -> tuple[int, str, float]:
    """(status, greedy text, seconds to the first streamed token)."""
    body = {"model": "tiny-llama", "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "stream": True}
    t0, first, text = time.monotonic(), None, ""
    with httpx.stream("POST", f"{router}/v1/completions", json=body, timeout=120) as r:
        if r.status_code != 200:
            return r.status_code, r.read().decode(), 0.0
        for line in r.iter_lines():
            if line.startswith("data: {"):
                text += json.loads(line[len("data: "):])["choices"][0]["text"]
                first = first or time.monotonic() - t0
    return r.status_code, text, first or 0.0


def test_idle_pools_go_to_zero_and_twenty_requests_bring_them_back_with_the_same_text(tmp_path):
    with disagg_up(tmp_path, SPEC) as up:
        _to_zero_and_back(up)


def _to_zero_and_back(up) -> None:
    launcher, router, text, get_status = up.launcher, up.router, up.text, up.status
    code, warm, _ = complete(router)
    assert code == 200 and warm, warm

    # STEP 1: idle -> both pools to zero, their workers drained and gone
    t0 = time.monotonic()
    wait_for(lambda: get_status()["replicas"] == {"prefill": 0, "decode": 0}, 30, f"scale to zero\n{text()}")
    wait_for(lambda: get_status()["workers"] == [], 60, f"the workers to drain\n{text()}")
    t_zero = time.monotonic() - t0
    zero = get_status()["autoscaling"]["scaleToZero"]
    assert zero["atZero"] and "idle for" in zero["reason"] and zero["since"], zero
    assert "autoscale: prefill 1 -> 0 (ScaledToZero)" in text() and "decode 1 -> 0 (ScaledToZero)" in text()
    assert httpx.get(f"{router}/ready", timeout=5).status_code == 200  # holds: stays reachable at zero

    # STEP 2: 20 concurrent requests at zero: held, then all served with the warm run's text
    t1 = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(20) as pool:
        answers = list(pool.map(lambda _: complete(router), range(20)))
    t_burst = time.monotonic() - t1
    assert [(c, t) for c, t, _ in answers] == [(200, warm)] * 20, answers
    assert get_status()["replicas"] == {"prefill": 1, "decode": 1}
    zero = get_status()["autoscaling"]["scaleToZero"]
    assert not zero["atZero"] and zero["leftZeroAt"], zero
    assert "prefill 0 -> 1 (ScaledFromZero)" in text() and "decode 0 -> 1 (ScaledFromZero)" in text()
    held = metric(router, "disagg:router_cold_start_seconds_count")
    cold = metric(router, "disagg:router_cold_start_seconds_sum") / held
    assert held == 20 and metric(router, "disagg:router_held_requests") == 0
    firsts = sorted(f for _, _, f in answers)
    print(f"\nscale to zero {t_zero:.1f}s after idle began; 20 requests at zero served in {t_burst:.1f}s; "
          f"cold start (held -> first token) mean {cold:.2f}s, client first token min {firsts[0]:.2f}s "
          f"max {firsts[-1]:.2f}s")

    # STEP 3: SIGTERM stops everything
    kids = children_of(launcher.pid)
    launcher.send_signal(signal.SIGTERM)
    assert launcher.wait(60) == 0
    assert [pid for pid in kids if alive(pid)] == []


def answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def test_a_request_held_past_hold_seconds_gets_503_with_retry_after(tmp_path):
    """A router whose only decode endpoint never comes up (nothing listens there)."""
    port, nowhere = free_port(), free_port()
    router = subprocess.Popen([*CLI, "router", "--host", "127.0.0.1", "--port", str(port), "--decode",
                               f"http://127.0.0.1:{nowhere}", "--hold-seconds", "1.5"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: answers(f"{url}/ready"), 30, "the router")
        t0 = time.monotonic()
        r = httpx.post(f"{url}/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 4}, timeout=30)
        took = time.monotonic() - t0
        assert r.status_code == 503 and r.headers["retry-after"] == "2", r.text
        assert "within the 1.5 s this request was held" in r.json()["error"]["message"] and 1.5 <= took < 5, took
    finally:
        router.terminate()
        router.wait(30)
