"""Scale to zero with pods: an autoscaled resource with scaleToZero goes to 0 prefill and 0 decode pods once idle;
then 20 concurrent requests reach the router pod (still Ready: it holds them), the operator sees the held count
and brings both pools back at once, and every request returns 200 with the warm run's greedy text. The CR's
status and Events tell the story; the cold start (held -> first token) is read from the router's histogram."""
from __future__ import annotations

import concurrent.futures
import json
import time

import httpx
import pytest
from serving_helpers import NIXL_MISSING, metric, nixl_available

from scenario import MODEL, PROMPT, cr_manifest, delete_and_wait, live_pods, router_url, wait_ready, \
    wait_router_pairs
from waiting import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not nixl_available(), reason=NIXL_MISSING)]

AUTOSCALING = {
    "enabled": True, "intervalSeconds": 1,
    "prefill": {"minReplicas": 1, "maxReplicas": 1}, "decode": {"minReplicas": 1, "maxReplicas": 1},
    "scaleToZero": {"enabled": True, "idleSeconds": 4, "holdSeconds": 120, "maxHeldRequests": 50},
}


def complete(router: str) -> tuple[int, str]:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "stream": True}
    text = ""
    with httpx.stream("POST", f"{router}/v1/completions", json=body, timeout=150) as r:
        if r.status_code != 200:
            return r.status_code, r.read().decode()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                text += json.loads(line[len("data: "):])["choices"][0]["text"]
    return r.status_code, text


def events(cluster, reason: str) -> list[dict]:
    return [e for e in cluster.store.list_objects("", "v1", "events") if e.get("reason") == reason]


def test_idle_resource_scales_to_zero_pods_and_twenty_requests_bring_both_pools_back(cluster, checkpoint):
    name = "zero"
    cluster.apply(cr_manifest(name, checkpoint, autoscaling=AUTOSCALING))
    wait_ready(cluster, name)
    wait_router_pairs(cluster, name)
    router = router_url(cluster, name)
    code, warm = complete(router)
    assert code == 200 and warm, warm

    # STEP 1: idle -> no prefill and no decode pod; status and Events say so
    t0 = time.monotonic()
    wait_for(lambda: not live_pods(cluster, name, "prefill") and not live_pods(cluster, name, "decode")
             and not cluster.pods({"app.kubernetes.io/instance": name, "app.kubernetes.io/component": "decode"}),
             90, f"both pools at zero pods\n{cluster.logs()}", interval=0.5)
    t_zero = time.monotonic() - t0
    zero = cluster.cr(name)["status"]["autoscaling"]["scaleToZero"]
    assert zero["atZero"] and zero["reason"].startswith("idle for") and zero["since"], zero
    assert {e["message"].split(" from ")[0] for e in events(cluster, "ScaledToZero")} == {
        "scaled prefill", "scaled decode"}, events(cluster, "ScaledToZero")
    assert httpx.get(f"{router}/ready", timeout=5).status_code == 200  # still in its Service

    # STEP 2: 20 concurrent requests at zero: held, both pools back, every one served with the warm text
    t1 = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(20) as pool:
        answers = list(pool.map(lambda _: complete(router), range(20)))
    t_burst = time.monotonic() - t1
    assert answers == [(200, warm)] * 20, answers
    assert len(live_pods(cluster, name, "prefill")) == 1 and len(live_pods(cluster, name, "decode")) == 1
    status = cluster.cr(name)["status"]["autoscaling"]
    assert not status["scaleToZero"]["atZero"] and status["scaleToZero"]["leftZeroAt"], status
    assert len(events(cluster, "ScaledFromZero")) == 2, events(cluster, "ScaledFromZero")
    held = metric(router, "disagg:router_cold_start_seconds_count")
    cold = metric(router, "disagg:router_cold_start_seconds_sum") / held
    assert held == 20 and metric(router, "disagg:router_held_requests") == 0
    delete_and_wait(cluster, name)
    print(f"\nscale to zero: pods gone {t_zero:.1f}s after idle began; 20 requests at zero served in "
          f"{t_burst:.1f}s; cold start (held -> first token) mean {cold:.2f}s")
