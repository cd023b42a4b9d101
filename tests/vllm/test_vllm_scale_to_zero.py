"""Scale to zero with engine vllm: `disagg up` with spec.autoscaling.scaleToZero and 1 prefill + 1 decode
`vllm serve` (each behind disagg pd-proxy). Idle for idleSeconds, both pools go to zero processes; then 20
concurrent requests arrive: the router holds them, the launcher brings both vLLM workers back at once, and every
request gets 200 with the warm run's greedy text. The cold start (held -> first byte) is the router's histogram,
printed: vLLM's start-up is most of it."""
from __future__ import annotations

import concurrent.futures
import functools
import signal
import time

import httpx
import waiting
from serving_helpers import metric_sum
from test_vllm_up import vllm_spec
from vllm_env import STARTUP_S, disagg_up, generate

from disagg.worker.local.process import free_port

wait_for = functools.partial(waiting.wait_for, interval=0.5)


def zero_spec(model_dir: str) -> dict:
    doc = vllm_spec(model_dir)
    doc["metadata"]["name"] = "vllm-zero"
    one = {"minReplicas": 1, "maxReplicas": 1}
    doc["spec"]["autoscaling"] = {
        "enabled": True, "intervalSeconds": 2, "prefill": one, "decode": one,
        # the hold outlasts two vLLM start-ups on a loaded 2-core box
        "scaleToZero": {"enabled": True, "idleSeconds": 5, "holdSeconds": 420, "maxHeldRequests": 50}}
    return doc


def test_idle_vllm_pools_go_to_zero_and_twenty_requests_bring_them_back_with_the_same_text(
        vllm_executable, vllm_model_dir, tmp_path):
    port, status_port = free_port(), free_port()
    status = lambda: httpx.get(f"http://127.0.0.1:{status_port}/status", timeout=30).json()  # noqa: E731
    with disagg_up(zero_spec(vllm_model_dir), tmp_path, vllm_executable, port, STARTUP_S, "  -> ",
                   ["--status-port", str(status_port)]) as up:
        router, text = f"http://127.0.0.1:{port}", up["output"]
        warm = generate(router, "completion", False)

        wait_for(lambda: status()["replicas"] == {"prefill": 0, "decode": 0}, 120, f"scale to zero\n{text()}")
        wait_for(lambda: status()["workers"] == [], 180, f"the vLLM workers to drain and stop\n{text()}")
        assert status()["autoscaling"]["scaleToZero"]["atZero"]
        assert httpx.get(f"{router}/ready", timeout=10).status_code == 200  # it holds: reachable at zero

        t0 = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(20) as pool:
            texts = list(pool.map(lambda _: generate(router, "completion", False), range(20)))
        took = time.monotonic() - t0
        assert texts == [warm] * 20
        assert status()["replicas"] == {"prefill": 1, "decode": 1}
        assert "prefill 0 -> 1 (ScaledFromZero)" in text() and "decode 0 -> 1 (ScaledFromZero)" in text()
        held = metric_sum(router, "disagg:router_cold_start_seconds_count")
        cold = metric_sum(router, "disagg:router_cold_start_seconds_sum") / held
        assert held == 20 and metric_sum(router, "disagg:router_held_requests") == 0
        print(f"\nvLLM: 20 requests at zero served in {took:.1f}s; cold start (held -> first byte) mean {cold:.1f}s")

        up["launcher"].send_signal(signal.SIGTERM)
        assert up["launcher"].wait(180) == 0
