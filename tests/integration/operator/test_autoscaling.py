"""The autoscaler end to end: kopf (in a thread) against the emulated API server, worker pods whose /metrics are
fake workers on 127.0.0.1 (the real metric names and labels), found through the pods' podIP and the
disagg.dev/metrics-port annotation.

The emulator runs no controllers: the test creates the Pod objects a ReplicaSet would, and nothing removes the
pod marked for deletion; the assertions are on what the operator writes."""
from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import pytest
from fake_worker import FakeWorker
from test_operator import NAME, NS, children_created, cr, create, deployment, play_controller

from emulator import EmulatorThread
from waiting import wait_for

from disagg.operator.autoscaling import cluster as sc
from disagg.operator import naming

MERGE = {"Content-Type": "application/merge-patch+json"}


def autoscaling_spec(example: dict[str, Any], **autoscaling: Any) -> dict[str, Any]:
    doc = copy.deepcopy(example)
    doc["spec"]["prefill"]["replicas"], doc["spec"]["decode"]["replicas"] = 1, 2
    doc["spec"]["autoscaling"] = {"enabled": True, "intervalSeconds": 1,
                                  "prefill": {"minReplicas": 1, "maxReplicas": 3},
                                  "decode": {"minReplicas": 1, "maxReplicas": 3},
                                  "stabilization": {"scaleUpSeconds": 0, "scaleDownSeconds": 0}, **autoscaling}
    return doc


def add_pod(api: EmulatorThread, role: str, worker: FakeWorker) -> str:
    """A running, ready worker pod of the resource whose metrics are served by `worker`."""
    name = f"{NAME}-{role}-{worker.port}"
    labels = {"app.kubernetes.io/name": "disagg", "app.kubernetes.io/instance": NAME,
              "app.kubernetes.io/component": role}
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": name, "labels": labels,
                        "annotations": {naming.ANNOTATION_METRICS_PORT: str(worker.port)}},
           "spec": {"containers": [{"name": role, "image": "x"}]}}
    status = {"phase": "Running", "podIP": "127.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]}
    with api.client() as http:
        http.post(f"/api/v1/namespaces/{NS}/pods", json=pod).raise_for_status()
        http.patch(f"/api/v1/namespaces/{NS}/pods/{name}/status", json={"status": status},
                   headers=MERGE).raise_for_status()
    return name


@pytest.fixture
def workers(cluster: EmulatorThread) -> Iterator[dict[str, list[FakeWorker]]]:
    """One prefill and two decode fake workers, each behind a Pod object."""
    pool = {"prefill": [FakeWorker("prefill")], "decode": [FakeWorker("decode"), FakeWorker("decode")]}
    try:
        yield pool
    finally:
        for w in pool["prefill"] + pool["decode"]:
            w.stop()


def start(api: EmulatorThread, doc: dict[str, Any], workers: dict[str, list[FakeWorker]]) -> dict[str, str]:
    create(api, doc)
    wait_for(lambda: children_created(api), what="all children")
    for role in ("prefill", "decode", "router"):
        play_controller(api, role)
    return {add_pod(api, role, w): role for role, ws in workers.items() for w in ws}


def events(api: EmulatorThread, reason: str) -> list[dict[str, Any]]:
    return [e for e in api.emulator.list_objects("", "v1", "events", NS) if e.get("reason") == reason]


def replicas(api: EmulatorThread, role: str) -> int:
    return deployment(api, role)["spec"]["replicas"]  # type: ignore[index]


def autoscaling_status(api: EmulatorThread) -> dict[str, Any]:
    return (cr(api).get("status") or {}).get("autoscaling") or {}


def test_decode_bound_scales_decode_up_with_status_event_and_metrics(cluster, operator, example, workers):
    for w in workers["decode"]:
        w.set(kv_cache_usage=0.95, running=30)  # over the 80 % target
    workers["prefill"][0].set(waiting=1)
    start(cluster, autoscaling_spec(example), workers)

    wait_for(lambda: replicas(cluster, "decode") == 3, what="decode scaled to 3")
    assert replicas(cluster, "prefill") == 1
    last = wait_for(lambda: autoscaling_status(cluster).get("lastDecision"), what="lastDecision")
    assert (last["role"], last["from"], last["to"], last["reason"], last["bottleneck"]) == \
        ("decode", 2, 3, "DecodeBound", "DecodeBound")
    assert last["metrics"]["decodeKvCacheUsagePercent"] == "95"
    assert last["metrics"]["prefillWaitingRequestsPerPod"] == "1"
    # the next decision wants 4: held at maxReplicas
    scaled = wait_for(lambda: autoscaling_status(cluster).get("decode", {}).get("limitedBy") and
                      autoscaling_status(cluster)["decode"], what="ScalingLimited at max")
    assert {k: scaled.get(k) for k in ("current", "desired", "reason", "limitedBy")} == \
        {"current": 3, "desired": 3, "reason": "DecodeBound", "limitedBy": "TooManyReplicas"}
    assert "kvCacheUsage" in scaled["signalsUsed"]  # status names what the decision read
    conditions = {c["type"]: (c["status"], c["reason"]) for c in cr(cluster)["status"]["conditions"]}
    assert conditions["ScalingActive"] == ("True", "ValidMetrics")
    assert conditions["ScalingLimited"] == ("True", "TooManyReplicas")
    assert conditions["TransferBound"][0] == "False"
    assert "Ready" in conditions  # the reconcile pass's conditions stay next to the autoscaler's
    [event] = wait_for(lambda: events(cluster, "ScaledUp"), what="a ScaledUp Event")
    assert event["type"] == "Normal" and event["message"] == "scaled decode from 2 to 3: DecodeBound"
    assert event["involvedObject"]["name"] == NAME

    labels = {"namespace": NS, "name": NAME, "role": "decode"}
    get = operator.metrics.registry.get_sample_value
    assert get("disagg_operator_desired_replicas", labels) == 3
    # counted after the decision's status is written: the held-at-max decision may land a moment later
    wait_for(lambda: (get("disagg_operator_scaling_decisions_total", {**labels, "reason": "DecodeBound"}) or 0) >= 2,
             what="two DecodeBound decisions counted")


def test_scale_down_marks_the_least_loaded_pod(cluster, operator, example, workers):
    busy, idle = workers["decode"]
    busy.set(kv_cache_usage=0.2, running=9)
    idle.set(kv_cache_usage=0.1, running=1)
    pods = start(cluster, autoscaling_spec(example), workers)
    wait_for(lambda: replicas(cluster, "decode") == 1, what="decode scaled to 1")
    idle_pod = next(name for name in pods if name.endswith(str(idle.port)))
    cost = {name: (cluster.emulator.get_object("", "v1", "pods", NS, name)["metadata"].get("annotations") or {})
            .get(naming.ANNOTATION_DELETION_COST) for name, role in pods.items() if role == "decode"}
    assert cost == {idle_pod: sc.VICTIM_DELETION_COST, next(n for n in cost if n != idle_pod): None}
    [event] = wait_for(lambda: events(cluster, "ScaledDown"), what="a ScaledDown Event")
    assert event["message"] == "scaled decode from 2 to 1: Underutilized"
    # the cost was written before the replicas
    writes = [r.path for r in cluster.emulator.requests if r.method == "PATCH"]
    assert writes.index(f"/api/v1/namespaces/{NS}/pods/{idle_pod}") < \
        writes.index(f"/apis/apps/v1/namespaces/{NS}/deployments/{NAME}-decode")
    verbs = cluster.emulator.api_verbs()
    for verb in (("list", "", "pods"), ("patch", "", "pods"), ("create", "", "events")):
        assert verb in verbs
    for verb, group, resource in sorted(verbs):  # shown with -s: the rules a Role for the operator needs
        print("RBAC", verb, group or "core", resource)


def test_dry_run_reports_and_patches_nothing(cluster, operator, example, workers):
    for w in workers["decode"]:
        w.set(kv_cache_usage=0.95)
    start(cluster, autoscaling_spec(example, dryRun=True), workers)
    before = len(cluster.emulator.requests)
    [event] = wait_for(lambda: events(cluster, "DryRunScaledUp"), what="a DryRunScaledUp Event")
    assert event["message"] == "would scale decode from 2 to 3: DecodeBound"
    st = autoscaling_status(cluster)
    assert st["dryRun"] is True and st["decode"]["desired"] == 3 and st["lastDecision"]["dryRun"] is True
    seen = len([r for r in cluster.emulator.requests if r.path.endswith("/pods")])
    wait_for(lambda: len([r for r in cluster.emulator.requests if r.path.endswith("/pods")]) >= seen + 2,
             what="two more decisions")
    patched = {r.path for r in cluster.emulator.writes(before) if r.method == "PATCH"}
    assert not any("/deployments/" in p or "/pods/" in p for p in patched), patched
    assert replicas(cluster, "decode") == 2
    assert len(events(cluster, "DryRunScaledUp")) == 1  # reported once, not every interval


def test_manual_replica_edit_is_reverted_with_an_event(cluster, operator, example, workers):
    for w in workers["decode"]:
        w.set(kv_cache_usage=0.8)  # on target: hold at 2
    start(cluster, autoscaling_spec(example), workers)
    wait_for(lambda: autoscaling_status(cluster).get("decode", {}).get("reason") == "WithinTolerance",
             what="a decision within tolerance")
    with cluster.client() as http:  # kubectl scale --replicas=5 (the emulator has no /scale)
        http.patch(f"/apis/apps/v1/namespaces/{NS}/deployments/{NAME}-decode", json={"spec": {"replicas": 5}},
                   headers=MERGE).raise_for_status()
    [event] = wait_for(lambda: events(cluster, "ManualScaleReverted"), what="a ManualScaleReverted Event")
    assert replicas(cluster, "decode") == 2
    assert event["type"] == "Warning"
    assert event["message"] == (f"Deployment {NAME}-decode replicas set to 5 outside the operator; restored 2 "
                                f"from {sc.REVERTED_SOURCE}")
