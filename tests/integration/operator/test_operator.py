"""The operator (kopf, in a thread) against an emulated API server over real HTTP on 127.0.0.1.

The emulator runs no controllers: tests play the Deployment controller by patching child status."""
from __future__ import annotations

import copy
import os
import shutil
import subprocess
from typing import Any

import pytest

from emulator import EmulatorThread
from operator_harness import CR, EXAMPLES, RESYNC_SECONDS, OperatorThread, quiesce
from waiting import wait_for

from disagg.operator import manifests as m
from disagg.operator import naming

NS = "default"
NAME = "llama3-8b"
ROLES = ("prefill", "decode", "router")
CHILDREN = {  # (group, version, plural) -> names
    ("apps", "v1", "deployments"): {f"{NAME}-prefill", f"{NAME}-decode", f"{NAME}-router"},
    ("", "v1", "services"): {NAME, f"{NAME}-prefill", f"{NAME}-decode"},
    ("", "v1", "serviceaccounts"): {f"{NAME}-router"},
    ("rbac.authorization.k8s.io", "v1", "roles"): {f"{NAME}-router"},
    ("rbac.authorization.k8s.io", "v1", "rolebindings"): {f"{NAME}-router"},
}


# ---------------------------------------------------------------- helpers
def create(api: EmulatorThread, doc: dict[str, Any]) -> None:
    with api.client() as http:
        http.post(f"/apis/{CR[0]}/{CR[1]}/namespaces/{NS}/{CR[2]}", json=doc).raise_for_status()


def patch_spec(api: EmulatorThread, spec_patch: dict[str, Any], name: str = NAME) -> None:
    with api.client() as http:
        http.patch(f"/apis/{CR[0]}/{CR[1]}/namespaces/{NS}/{CR[2]}/{name}", json={"spec": spec_patch},
                   headers={"Content-Type": "application/merge-patch+json"}).raise_for_status()


def cr(api: EmulatorThread, name: str = NAME) -> dict[str, Any]:
    obj = api.emulator.get_object(*CR, NS, name)
    assert obj is not None
    return obj


def deployment(api: EmulatorThread, role: str) -> dict[str, Any] | None:
    return api.emulator.get_object("apps", "v1", "deployments", NS, f"{NAME}-{role}")


def all_children(api: EmulatorThread) -> dict[tuple, list[dict]]:
    return {res: api.emulator.list_objects(*res, NS) for res in CHILDREN}


def condition(obj: dict[str, Any], ctype: str) -> dict[str, Any] | None:
    return next((c for c in (obj.get("status") or {}).get("conditions", []) if c["type"] == ctype), None)


def cond_is(api: EmulatorThread, ctype: str, status: str, reason: str | None = None, name: str = NAME):
    def probe():
        c = condition(cr(api, name), ctype)
        return c if c and c["status"] == status and (reason is None or c["reason"] == reason) else None
    return probe


def create_ready(api: EmulatorThread, doc: dict[str, Any]) -> None:
    """Create the resource, let the controllers report every pool's pods running, wait for Ready."""
    create(api, doc)
    wait_for(lambda: children_created(api), what="all children")
    for role in ROLES:
        play_controller(api, role)
    wait_for(cond_is(api, "Ready", "True"), what="Ready")


def play_controller(api: EmulatorThread, role: str, ready: int | None = None) -> None:
    """What the Deployment controller would report once the current template's pods run."""
    dep = deployment(api, role)
    assert dep is not None
    want = dep["spec"]["replicas"]
    status = {"observedGeneration": dep["metadata"]["generation"], "replicas": want, "updatedReplicas": want,
              "readyReplicas": want if ready is None else ready, "availableReplicas": want if ready is None else ready}
    with api.client() as http:
        http.patch(f"/apis/apps/v1/namespaces/{NS}/deployments/{NAME}-{role}/status", json={"status": status},
                   headers={"Content-Type": "application/merge-patch+json"}).raise_for_status()


def children_created(api: EmulatorThread) -> bool:
    return all({o["metadata"]["name"] for o in objs} == CHILDREN[res] for res, objs in all_children(api).items())


def passes_seen(api: EmulatorThread) -> int:
    """Each pass GETs the prefill Deployment once."""
    path = f"/apis/apps/v1/namespaces/{NS}/deployments/{NAME}-prefill"
    return sum(1 for r in api.emulator.requests if r.method == "GET" and r.path == path)


def settle(api: EmulatorThread) -> None:
    """Wait until the operator has stopped writing (status caught up with the children)."""
    def quiet() -> bool:
        start_req, start_pass = len(api.emulator.requests), passes_seen(api)
        wait_for(lambda: passes_seen(api) >= start_pass + 2, 5, "two passes")
        return not api.emulator.writes(start_req)
    wait_for(quiet, 10, "no writes across two passes")


# ---------------------------------------------------------------- tests
def test_resource_becomes_children_with_owner_references_and_pod_templates(cluster, operator, example):
    create(cluster, example)
    wait_for(lambda: children_created(cluster), what="all children")
    owner_uid = cr(cluster)["metadata"]["uid"]
    for objs in all_children(cluster).values():
        for obj in objs:
            ref = obj["metadata"]["ownerReferences"][0]
            assert (ref["kind"], ref["name"], ref["uid"], ref["controller"]) == \
                ("DisaggregatedInference", NAME, owner_uid, True)
            labels = obj["metadata"]["labels"]
            assert labels[naming.LABEL_INSTANCE] == NAME and labels[naming.LABEL_MANAGED_BY] == naming.MANAGED_BY

    prefill = deployment(cluster, "prefill")
    pod = prefill["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert prefill["spec"]["replicas"] == 2
    assert c["image"] == example["spec"]["image"]
    assert c["args"][:3] == ["worker", "--role", "prefill"]
    assert c["args"][c["args"].index("--kv-side-channel-host") + 1] == "$(POD_IP)"
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}} in c["env"]
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready" and c["livenessProbe"]["httpGet"]["path"] == "/health"
    assert c["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", "5"]
    assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "8Gi"}} in pod["volumes"]
    assert pod["terminationGracePeriodSeconds"] == 120
    assert naming.ANNOTATION_CONFIG_HASH in prefill["spec"]["template"]["metadata"]["annotations"]
    router = deployment(cluster, "router")["spec"]["template"]["spec"]
    assert router["serviceAccountName"] == f"{NAME}-router"
    assert "--prefill-selector" in router["containers"][0]["args"]
    headless = cluster.emulator.get_object("", "v1", "services", NS, f"{NAME}-decode")
    assert headless["spec"]["clusterIP"] == "None"
    assert {p["port"] for p in headless["spec"]["ports"]} == {8000, 5600}

    wait_for(cond_is(cluster, "Progressing", "True", "RolloutInProgress"), what="Progressing")
    status = cr(cluster)["status"]
    assert status["endpoint"] == f"http://{NAME}.{NS}.svc:8000"
    assert status["observedGeneration"] == cr(cluster)["metadata"]["generation"]
    assert condition(cr(cluster), "Ready")["status"] == "False"


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not installed")
def test_kubectl_apply_drives_the_operator(cluster, operator):
    env = dict(os.environ)
    run = lambda *args: subprocess.run(["kubectl", *args], env=env, capture_output=True, text=True,  # noqa: E731
                                       timeout=30)
    applied = run("apply", "--validate=false", "-f", str(EXAMPLES / "llama3-8b-gpu.yaml"))
    assert applied.returncode == 0, applied.stderr
    wait_for(lambda: children_created(cluster), what="all children")
    got = run("get", "dinf", NAME, "-o", "jsonpath={.status.endpoint}")
    assert got.returncode == 0 and got.stdout == f"http://{NAME}.{NS}.svc:8000", got.stderr


def test_status_follows_child_readiness(cluster, operator, example):
    create_ready(cluster, example)
    assert condition(cr(cluster), "Ready")["reason"] == "ReplicasReady"
    obj = cr(cluster)
    assert condition(obj, "Progressing")["reason"] == "RolloutComplete"
    assert condition(obj, "Degraded")["status"] == "False"
    assert obj["status"]["decode"] == {"replicas": 4, "readyReplicas": 4, "updatedReplicas": 4}

    play_controller(cluster, "decode", ready=1)  # three decode pods fail /ready
    wait_for(cond_is(cluster, "Degraded", "True", "ReplicasUnavailable"), what="Degraded=True")
    assert condition(cr(cluster), "Ready")["status"] == "False"
    assert cr(cluster)["status"]["decode"]["readyReplicas"] == 1


def test_spec_update_rolls_both_pools_and_stays_progressing_until_both_run_it(cluster, operator, example):
    create_ready(cluster, example)
    before = {r: copy.deepcopy(deployment(cluster, r)) for r in ROLES}
    old_revision = cr(cluster)["status"]["revision"]

    patch_spec(cluster, {"image": "registry.example.com/disagg-worker:0.2.0"})
    wait_for(lambda: deployment(cluster, "decode")["spec"]["template"]["spec"]["containers"][0]["image"].endswith(
        "0.2.0") and deployment(cluster, "prefill")["spec"]["template"]["spec"]["containers"][0]["image"].endswith(
        "0.2.0"), what="new image in both pools")
    for role in ("prefill", "decode"):
        old_t, new_t = before[role]["spec"]["template"], deployment(cluster, role)["spec"]["template"]
        assert new_t["metadata"]["annotations"][naming.ANNOTATION_CONFIG_HASH] != \
            old_t["metadata"]["annotations"][naming.ANNOTATION_CONFIG_HASH]
        assert new_t["metadata"]["labels"][naming.LABEL_REVISION] != old_t["metadata"]["labels"][naming.LABEL_REVISION]
    wait_for(cond_is(cluster, "Progressing", "True", "RolloutInProgress"), what="Progressing")
    assert cr(cluster)["status"]["revision"] != old_revision

    play_controller(cluster, "prefill")  # prefill (and the router, same image) done, decode still rolling
    play_controller(cluster, "router")
    settle(cluster)
    assert condition(cr(cluster), "Progressing")["status"] == "True"
    assert "decode" in condition(cr(cluster), "Progressing")["message"]
    play_controller(cluster, "decode")
    wait_for(cond_is(cluster, "Progressing", "False", "RolloutComplete"), what="rollout complete")

    # a pool-only change rolls that pool only and keeps the serving revision (replicas come from the spec only
    # with autoscaling off)
    patch_spec(cluster, {"decode": {"replicas": 5}, "autoscaling": {"enabled": False}})
    wait_for(lambda: deployment(cluster, "decode")["spec"]["replicas"] == 5, what="decode scaled")
    assert deployment(cluster, "prefill")["metadata"]["generation"] == \
        deployment(cluster, "prefill")["status"]["observedGeneration"]


def test_no_op_pass_makes_no_write_requests(cluster, operator, example):
    create_ready(cluster, example)
    settle(cluster)
    start_req, start_pass = len(cluster.emulator.requests), passes_seen(cluster)
    wait_for(lambda: passes_seen(cluster) >= start_pass + 3, 5, "three more passes")
    assert cluster.emulator.writes(start_req) == []


def test_invalid_spec_gets_condition_and_one_event_and_no_retries(cluster, operator, example):
    bad = copy.deepcopy(example)
    bad["spec"]["autoscaling"]["decode"] = {"minReplicas": 6, "maxReplicas": 2}
    create(cluster, bad)
    c = wait_for(cond_is(cluster, "Degraded", "True", "InvalidSpec"), what="InvalidSpec")
    assert "spec.autoscaling.decode.minReplicas" in c["message"]
    assert condition(cr(cluster), "Ready")["reason"] == "InvalidSpec"

    def invalid_events() -> list[dict]:
        return [e for e in cluster.emulator.list_objects("", "v1", "events", NS) if e.get("reason") == "InvalidSpec"]
    wait_for(invalid_events, what="an InvalidSpec Event")
    settle(cluster)
    start_req, start_pass = len(cluster.emulator.requests), passes_seen(cluster)
    wait_for(lambda: passes_seen(cluster) >= start_pass + 3, 5, "three more passes")
    assert cluster.emulator.writes(start_req) == []
    assert len(invalid_events()) == 1
    assert all(not cluster.emulator.list_objects(*res, NS) for res in CHILDREN)

    patch_spec(cluster, {"autoscaling": {"decode": {"minReplicas": 1}}})  # fixed: now it is served
    wait_for(lambda: children_created(cluster), what="children after the fix")
    wait_for(cond_is(cluster, "Degraded", "False"), what="not degraded")


def test_restarted_operator_adopts_children_without_duplicates(cluster, example):
    first = OperatorThread().start()
    try:
        create(cluster, example)
        wait_for(lambda: children_created(cluster), what="all children")
        settle(cluster)
    finally:
        first.stop()
    uids = {o["metadata"]["uid"] for objs in all_children(cluster).values() for o in objs}
    start_req = len(cluster.emulator.requests)
    second = OperatorThread().start()
    try:
        start_pass = passes_seen(cluster)
        wait_for(lambda: passes_seen(cluster) >= start_pass + 2, 5, "passes after restart")
    finally:
        second.stop()
    assert {o["metadata"]["uid"] for objs in all_children(cluster).values() for o in objs} == uids
    assert children_created(cluster)
    assert [r for r in cluster.emulator.writes(start_req) if r.method == "POST" and "events" not in r.path] == []


def test_transient_api_errors_are_retried(cluster, operator, example):
    cluster.emulator.inject_failure("POST", "/deployments", 503, times=2)
    create(cluster, example)
    wait_for(lambda: children_created(cluster), timeout=15, what="children despite two 503s")
    posts = [r for r in cluster.emulator.requests if r.method == "POST" and r.path.endswith("/deployments")]
    assert len(posts) == 3 + 2  # three Deployments, two answered 503 first


def test_request_log_gives_the_operators_rbac(cluster, operator, example):
    create(cluster, example)
    wait_for(lambda: children_created(cluster), what="all children")
    settle(cluster)
    verbs = cluster.emulator.api_verbs()
    assert ("patch", "disagg.dev", "disaggregatedinferences/status") in verbs
    assert ("create", "apps", "deployments") in verbs
    assert not any(v == "update" or v == "delete" for v, _, _ in verbs)
    for verb, group, resource in sorted(verbs):  # shown with -s: the rules a Role for the operator needs
        print("RBAC", verb, group or "core", resource)


def test_disagg_operator_command_runs_and_stops_on_sigint(cluster, example):
    import signal
    import sys

    import httpx

    from disagg.worker.local.process import free_port
    metrics_port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "disagg.worker.cli", "operator", "--namespace", NS,
                             "--resync-seconds", str(RESYNC_SECONDS), "--log-level", "WARNING",
                             "--metrics-port", str(metrics_port)],
                            env=dict(os.environ), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        create(cluster, example)
        wait_for(lambda: children_created(cluster) or proc.poll() is not None, 20, "children from the CLI")
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
        assert children_created(cluster)
        text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).text
        assert "# TYPE disagg_operator_desired_replicas gauge" in text
        assert "# TYPE disagg_operator_scaling_decisions_total counter" in text
        quiesce(cluster)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert proc.returncode == 0, proc.stdout.read() if proc.stdout else ""
