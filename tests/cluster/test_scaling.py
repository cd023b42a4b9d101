"""Scenario b: `kubectl patch` decode 1 -> 2 -> 1 while requests stream through the router: the added pod serves,
the removed one (the newest: the ReplicaSet rule) drains - preStop, SIGTERM, running requests finish - and no
request fails.
Scenario d: autoscaling on: streaming load fills decode's KV cache past its target, so the operator (reading the
pods' real /metrics) scales decode to 2; the added pod serves; with only a trickle left it scales back to 1,
removing the pod it marked with the lowest pod-deletion-cost; no request fails."""
from __future__ import annotations

import time

import pytest
from serving_helpers import NIXL_MISSING, metric, nixl_available

from scenario import Load, cr_manifest, delete_and_wait, live_pods, pod_url, router_url, wait_ready
from waiting import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not nixl_available(), reason=NIXL_MISSING)]


def _generated(pod: dict) -> float:
    try:
        return metric(pod_url(pod), "vllm:generation_tokens_total")
    except Exception:  # noqa: BLE001 - not serving (yet, or any more)
        return 0.0


def _drained_cleanly(cluster, pod_name: str, container: str = "decode") -> str:
    log = (cluster.log_dir / f"default_{pod_name}_{container}.log").read_text()
    assert "--- exec hook: sleep 5" in log and "received SIGTERM: draining" in log and "stopped" in log, log[-3000:]
    return log


def _scaled(cluster, name: str, n: int) -> list[dict]:
    cr = cluster.cr(name)
    pods = live_pods(cluster, name, "decode")
    ready = [p for p in pods if any(c["type"] == "Ready" and c["status"] == "True"
                                    for c in p.get("status", {}).get("conditions", []))]
    return ready if len(pods) == len(ready) == n and cr["status"]["decode"]["readyReplicas"] == n else []


def test_scaling_decode_through_the_spec_under_load_fails_no_request(cluster, checkpoint):
    name = "scale"
    t0 = time.monotonic()
    cluster.apply(cr_manifest(name, checkpoint))
    wait_ready(cluster, name)
    first = live_pods(cluster, name, "decode")[0]
    load = Load(router_url(cluster, name), clients=2, max_tokens=16)
    try:
        # 1 -> 2: the new pod becomes ready, the router discovers it and sends it requests
        cluster.patch_cr(name, {"spec": {"decode": {"replicas": 2}}})
        pods = wait_for(lambda: _scaled(cluster, name, 2), 90, f"2 ready decode pods\n{cluster.logs()}",
                        interval=0.5)
        added = next(p for p in pods if p["metadata"]["name"] != first["metadata"]["name"])
        wait_for(lambda: _generated(added) > 0, 30, "the added decode pod to serve", interval=0.5)
        served_before = len(load.outcomes)

        # 2 -> 1: the newest pod goes; it drains while the load goes on
        cluster.patch_cr(name, {"spec": {"decode": {"replicas": 1}}})
        wait_for(lambda: not any(p["metadata"]["name"] == added["metadata"]["name"]
                                 for p in cluster.pods()), 60, "the removed pod to go", interval=0.2)
        assert [p["metadata"]["name"] for p in live_pods(cluster, name, "decode")] == [first["metadata"]["name"]]
        _drained_cleanly(cluster, added["metadata"]["name"])
        time.sleep(1)  # the load keeps going against one decode pod
    finally:
        outcomes = load.stop()
    assert len(outcomes) > served_before > 0, (served_before, len(outcomes))
    assert not load.failures(), load.failures()
    t_delete = delete_and_wait(cluster, name)
    print(f"\nscenario b: {len(outcomes)} requests ok in {time.monotonic() - t0:.1f}s (delete {t_delete:.1f}s)")


AUTOSCALING = {
    "enabled": True, "intervalSeconds": 2,
    "prefill": {"minReplicas": 1, "maxReplicas": 1}, "decode": {"minReplicas": 1, "maxReplicas": 2},
    "targets": {"decode": {"kvCacheUsagePercent": 20}},
    "stabilization": {"scaleUpSeconds": 0, "scaleDownSeconds": 6},
}


def test_autoscaling_from_the_pods_metrics_scales_decode_up_under_load_and_back_when_idle(cluster, checkpoint):
    name = "autoscale"
    t0 = time.monotonic()
    # 64 blocks x 16 tokens: 8 streams of 96 tokens hold ~60% of decode's KV cache, one short request ~3%
    cluster.apply(cr_manifest(name, checkpoint, autoscaling=AUTOSCALING,
                              decode={"replicas": 1, "terminationGracePeriodSeconds": 20,
                                      "extraArgs": ["--num-kv-blocks", "64"]}))
    wait_ready(cluster, name)
    first = live_pods(cluster, name, "decode")[0]["metadata"]["name"]
    router = router_url(cluster, name)
    heavy = Load(router, clients=8, max_tokens=96)
    trickle = None
    try:
        pods = wait_for(lambda: _scaled(cluster, name, 2), 120, f"autoscaling to 2 decode pods\n{cluster.logs()}",
                        interval=0.5)
        up = cluster.cr(name)["status"]["autoscaling"]["lastDecision"]
        assert (up["role"], up["from"], up["to"], up["reason"]) == ("decode", 1, 2, "DecodeBound"), up
        added = next(p for p in pods if p["metadata"]["name"] != first)
        wait_for(lambda: _generated(added) > 0, 30, "the added decode pod to serve", interval=0.5)
        t_up = time.monotonic() - t0

        heavy.stop()
        trickle = Load(router, clients=1, max_tokens=8)
        t1 = time.monotonic()
        marked: dict[str, str] = {}

        def one_left() -> bool:
            for p in cluster.pods():  # remember which pod the operator marked for removal
                cost = (p["metadata"].get("annotations") or {}).get("controller.kubernetes.io/pod-deletion-cost")
                if cost is not None:
                    marked[p["metadata"]["name"]] = cost
            return len(cluster.pods({"app.kubernetes.io/instance": name, "app.kubernetes.io/component":
                                     "decode"})) == 1
        wait_for(one_left, 90, f"scale-down to 1 decode pod\n{cluster.logs()}", interval=0.2)
        t_down = time.monotonic() - t1
        down = cluster.cr(name)["status"]["autoscaling"]["lastDecision"]
        assert (down["role"], down["from"], down["to"], down["reason"]) == ("decode", 2, 1, "Underutilized"), down
        (kept,) = live_pods(cluster, name, "decode")
        removed = ({first, added["metadata"]["name"]} - {kept["metadata"]["name"]}).pop()
        assert marked.get(removed) == "-1000" and kept["metadata"]["name"] not in marked, (marked, removed)
        _drained_cleanly(cluster, removed)
        time.sleep(1)
    finally:
        heavy.stop()
        if trickle is not None:
            trickle.stop()
    assert heavy.outcomes and trickle.outcomes
    assert not heavy.failures() and not trickle.failures(), heavy.failures() + trickle.failures()
    delete_and_wait(cluster, name)
    print(f"\nscenario d: scaled up {t_up:.1f}s after the load began, down {t_down:.1f}s after it ended; "
          f"{len(heavy.outcomes)} long + {len(trickle.outcomes)} short requests ok")
