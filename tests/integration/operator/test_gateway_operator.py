"""The operator (kopf, in a thread) against the emulated API server: a child's name taken by another controller's
object is not adopted (a condition and an Event name both), and spec.gateway's children come and go with the
spec while the pool's status (written by the user's gateway controller) shows in InferencePoolReady."""
from __future__ import annotations

import copy
from typing import Any

from emulator import EmulatorThread, Kind
from test_operator import NAME, NS, ROLES, cond_is, cr, create, patch_spec, play_controller
from waiting import wait_for

POOLS = ("inference.networking.k8s.io", "v1", "inferencepools")
ROUTES = ("gateway.networking.k8s.io", "v1", "httproutes")
FOREIGN_OWNER = {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "legacy-llm", "uid": "f00",
                 "controller": True}


def events(api: EmulatorThread, reason: str) -> list[dict[str, Any]]:
    return [e for e in api.emulator.list_objects("", "v1", "events", NS) if e.get("reason") == reason]


def test_an_object_another_controller_owns_is_reported_and_left_alone(cluster, operator, example):
    foreign = {"apiVersion": "v1", "kind": "Service",
               "metadata": {"name": NAME, "namespace": NS, "labels": {"app": "legacy-llm"},
                            "ownerReferences": [FOREIGN_OWNER]},
               "spec": {"selector": {"app": "legacy-llm"}, "ports": [{"port": 80}]}}
    with cluster.client() as http:
        http.post(f"/api/v1/namespaces/{NS}/services", json=foreign).raise_for_status()
    create(cluster, example)
    wait_for(lambda: all(cluster.emulator.get_object("apps", "v1", "deployments", NS, f"{NAME}-{r}")
                         for r in ROLES), what="the Deployments")
    for role in ROLES:
        play_controller(cluster, role)
    c = wait_for(cond_is(cluster, "Degraded", "True", "ChildOwnedElsewhere"), what="the conflict reported")
    assert "Service llama3-8b is controlled by StatefulSet legacy-llm" in c["message"]
    assert wait_for(cond_is(cluster, "Ready", "False", "ChildOwnedElsewhere"), what="not Ready")
    event = wait_for(lambda: events(cluster, "ChildOwnedElsewhere"), what="an Event")[0]
    assert "StatefulSet legacy-llm" in event["message"] and "Service llama3-8b" in event["message"]
    svc = cluster.emulator.get_object("", "v1", "services", NS, NAME)
    assert svc["metadata"]["ownerReferences"] == [FOREIGN_OWNER] and svc["spec"]["selector"] == {"app": "legacy-llm"}
    assert not [r for r in cluster.emulator.requests
                if r.method == "PATCH" and r.path == f"/api/v1/namespaces/{NS}/services/{NAME}"]
    # the other controller lets go: the next pass creates ours and the resource is Ready
    with cluster.client() as http:
        http.delete(f"/api/v1/namespaces/{NS}/services/{NAME}").raise_for_status()
    wait_for(cond_is(cluster, "Ready", "True"), what="Ready once the name is free")
    svc = cluster.emulator.get_object("", "v1", "services", NS, NAME)
    assert svc["metadata"]["ownerReferences"][0]["uid"] == cr(cluster)["metadata"]["uid"]


def test_gateway_children_follow_the_spec_and_the_pool_status_shows(cluster, operator, example):
    cluster.emulator.declare(*POOLS, Kind("InferencePool", status_subresource=True))  # GIE's CRDs installed
    cluster.emulator.declare(*ROUTES, Kind("HTTPRoute", status_subresource=True))
    doc = copy.deepcopy(example)
    doc["spec"]["gateway"] = {"enabled": True, "httpRoute": {"gatewayName": "inference-gw"}}
    create(cluster, doc)
    wait_for(lambda: cluster.emulator.get_object(*POOLS, NS, NAME) and cluster.emulator.get_object(*ROUTES, NS, NAME)
             and cluster.emulator.get_object("apps", "v1", "deployments", NS, f"{NAME}-epp"), what="the gateway's")
    for role in (*ROLES, "epp"):
        play_controller(cluster, role)
    wait_for(cond_is(cluster, "Ready", "True"), what="Ready")
    wait_for(cond_is(cluster, "InferencePoolReady", "Unknown", "WaitingForGateway"), what="waiting for a gateway")
    assert cr(cluster)["status"]["endpointPicker"]["readyReplicas"] == 1
    parents = [{"parentRef": {"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": "inference-gw"},
                "conditions": [{"type": t, "status": "True", "reason": t, "message": "",
                                "lastTransitionTime": "2026-01-01T00:00:00Z"} for t in ("Accepted", "ResolvedRefs")]}]
    with cluster.client() as http:  # what the user's gateway controller writes
        http.patch(f"/apis/{POOLS[0]}/{POOLS[1]}/namespaces/{NS}/{POOLS[2]}/{NAME}/status",
                   json={"status": {"parents": parents}},
                   headers={"Content-Type": "application/merge-patch+json"}).raise_for_status()
    wait_for(cond_is(cluster, "InferencePoolReady", "True", "Accepted"), what="the pool accepted")
    patch_spec(cluster, {"gateway": {"enabled": False, "httpRoute": None}})
    wait_for(lambda: not cluster.emulator.get_object(*POOLS, NS, NAME)
             and not cluster.emulator.get_object(*ROUTES, NS, NAME)
             and not cluster.emulator.get_object("apps", "v1", "deployments", NS, f"{NAME}-epp")
             and not cluster.emulator.get_object("", "v1", "serviceaccounts", NS, f"{NAME}-worker"),
             what="the gateway's children removed")
    wait_for(lambda: "endpointPicker" not in cr(cluster)["status"]
             and all(c["type"] != "InferencePoolReady" for c in cr(cluster)["status"]["conditions"]),
             what="its status gone")
