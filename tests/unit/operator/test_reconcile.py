"""The reconcile pass against an in-memory cluster: what it writes, and that a settled pass writes nothing."""
from __future__ import annotations

import copy
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import yaml

from k8s_patch import apply_merge_patch

from disagg.operator import reconcile as r
from disagg.operator import spec as s
from disagg.operator.kube import PLURALS
from disagg.operator import naming

ROOT = Path(__file__).resolve().parents[3]
T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)


class FakeCluster:
    """Stores objects by (kind, namespace, name); counts writes; bumps generation on spec changes."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str, str], dict[str, Any]] = {}
        self.writes: list[tuple[str, str, dict]] = []  # (verb, "Kind/name", body)

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict | None:
        assert kind in PLURALS
        obj = self.objects.get((kind, namespace, name))
        return copy.deepcopy(obj) if obj else None

    def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        key = (obj["kind"], obj["metadata"]["namespace"], obj["metadata"]["name"])
        assert key not in self.objects
        self.writes.append(("create", f"{key[0]}/{key[2]}", obj))
        self.objects[key] = apply_merge_patch(obj, {"metadata": {"generation": 1}})
        return copy.deepcopy(self.objects[key])

    def patch(self, api_version, kind, namespace, name, patch, subresource=None):
        key = (kind, namespace, name)
        self.writes.append(("patch" + (f"/{subresource}" if subresource else ""), f"{kind}/{name}", patch))
        old = self.objects[key]
        new = apply_merge_patch(old, patch)
        if new.get("spec") != old.get("spec"):
            new["metadata"]["generation"] = old["metadata"].get("generation", 1) + 1
        self.objects[key] = new
        return copy.deepcopy(new)

    def delete(self, api_version, kind, namespace, name) -> None:
        self.writes.append(("delete", f"{kind}/{name}", {}))
        del self.objects[(kind, namespace, name)]

    def add_resource(self, doc: dict[str, Any]) -> dict[str, Any]:
        body = apply_merge_patch(doc, {"metadata": {"namespace": "ns", "uid": "uid-1", "generation": 1}})
        self.objects[(s.KIND, "ns", body["metadata"]["name"])] = body
        return body

    def resource(self, name: str = "llama3-8b") -> dict[str, Any]:
        return self.get(s.API_VERSION, s.KIND, "ns", name)  # type: ignore[return-value]

    def finish_rollouts(self, ready: int | None = None) -> None:
        for (kind, _, _), obj in self.objects.items():
            if kind == "Deployment":
                want = obj["spec"]["replicas"]
                obj["status"] = {"observedGeneration": obj["metadata"]["generation"], "replicas": want,
                                 "updatedReplicas": want, "readyReplicas": want if ready is None else ready}


def example() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "examples" / "llama3-8b-gpu.yaml").read_text())


def conditions(obj: dict[str, Any]) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in obj["status"]["conditions"]}


def run_pass(cluster: FakeCluster, now: datetime = T0) -> r.PassResult:
    result = r.reconcile(cluster.resource(), cluster, now)
    assert result is not None
    return result


def test_first_pass_creates_everything_second_pass_writes_nothing():
    cluster = FakeCluster()
    cluster.add_resource(example())
    first = run_pass(cluster)
    # 9 children, 3 NetworkPolicies, the hand-off key's Secret
    assert len(first.children_written) == 13 and first.status_written
    assert conditions(cluster.resource()) == {"Ready": ("False", "ReplicasNotReady"),
                                              "Progressing": ("True", "RolloutInProgress"),
                                              "Degraded": ("False", "AsExpected")}
    cluster.writes.clear()
    second = run_pass(cluster)
    assert (second.children_written, second.status_written, cluster.writes) == ([], False, [])


def test_status_follows_the_children_and_keeps_transition_times():
    cluster = FakeCluster()
    cluster.add_resource(example())
    run_pass(cluster, T0)
    cluster.finish_rollouts()
    run_pass(cluster, T0 + timedelta(seconds=10))
    obj = cluster.resource()
    assert conditions(obj) == {"Ready": ("True", "ReplicasReady"), "Progressing": ("False", "RolloutComplete"),
                               "Degraded": ("False", "AsExpected")}
    times = {c["type"]: c["lastTransitionTime"] for c in obj["status"]["conditions"]}
    assert times == {"Ready": "2026-01-01T00:00:10Z", "Progressing": "2026-01-01T00:00:10Z",
                     "Degraded": "2026-01-01T00:00:00Z"}  # Degraded stayed False: its time is kept
    assert obj["status"]["prefill"] == {"replicas": 2, "readyReplicas": 2, "updatedReplicas": 2}
    assert obj["status"]["observedGeneration"] == 1

    cluster.finish_rollouts(ready=0)
    run_pass(cluster, T0 + timedelta(seconds=20))
    assert conditions(cluster.resource())["Degraded"] == ("True", "ReplicasUnavailable")


def test_spec_change_patches_only_what_changed_and_drops_removed_keys():
    cluster = FakeCluster()
    cluster.add_resource(example())
    run_pass(cluster)
    cluster.writes.clear()
    changed = cluster.resource()
    del changed["spec"]["decode"]["nodeSelector"]
    cluster.objects[(s.KIND, "ns", "llama3-8b")] = apply_merge_patch(changed, {"metadata": {"generation": 2}})
    result = run_pass(cluster)
    assert result.children_written == ["Deployment/llama3-8b-decode"]
    patch = next(body for verb, what, body in cluster.writes if what == "Deployment/llama3-8b-decode")
    assert patch["spec"]["template"]["spec"]["nodeSelector"] is None  # merge-patch null deletes it
    dep = cluster.get("apps/v1", "Deployment", "ns", "llama3-8b-decode")
    assert "nodeSelector" not in dep["spec"]["template"]["spec"]


def test_hand_scaling_is_undone_without_autoscaling():
    cluster = FakeCluster()
    doc = example()
    doc["spec"]["autoscaling"]["enabled"] = False
    cluster.add_resource(doc)
    run_pass(cluster)
    cluster.objects[("Deployment", "ns", "llama3-8b-decode")]["spec"]["replicas"] = 1
    assert run_pass(cluster).children_written == ["Deployment/llama3-8b-decode"]
    assert cluster.get("apps/v1", "Deployment", "ns", "llama3-8b-decode")["spec"]["replicas"] == 4


def test_invalid_spec_touches_no_child_and_reports_once():
    cluster = FakeCluster()
    doc = example()
    doc["spec"]["kvTransfer"]["connector"] = "Unknown"
    cluster.add_resource(doc)
    first = run_pass(cluster)
    assert first.status_written and [p.path for p in first.problems] == ["spec.kvTransfer.connector"]
    assert [w for w in cluster.writes if w[0] != "patch/status"] == []
    assert conditions(cluster.resource())["Degraded"] == ("True", "InvalidSpec")
    cluster.writes.clear()
    second = run_pass(cluster)
    assert second.problems and not second.status_written and cluster.writes == []


def test_autoscaler_status_is_left_alone():
    cluster = FakeCluster()
    body = cluster.add_resource(example())
    scaling = {"type": "ScalingActive", "status": "True", "reason": "ValidMetrics", "lastTransitionTime": "t"}
    body["status"] = {"autoscaling": {"decode": {"current": 4, "desired": 4}}, "conditions": [scaling]}
    run_pass(cluster)
    status = cluster.resource()["status"]
    assert status["autoscaling"]["decode"]["desired"] == 4
    assert [c["type"] for c in status["conditions"]] == ["Ready", "Progressing", "Degraded", "ScalingActive"]
    status_patch = next(b for v, _, b in cluster.writes if v == "patch/status")
    assert "autoscaling" not in status_patch["status"]


def with_autoscaler_status(doc: dict[str, Any], status: dict[str, Any]) -> FakeCluster:
    cluster = FakeCluster()
    body = cluster.add_resource(doc)
    body["status"] = {"autoscaling": status}
    return cluster


def replicas(cluster: FakeCluster) -> tuple[int, int]:
    return tuple(cluster.get("apps/v1", "Deployment", "ns", f"llama3-8b-{r}")["spec"]["replicas"]  # type: ignore
                 for r in ("prefill", "decode"))


def scale(cluster: FakeCluster, role: str, n: int) -> None:
    """What the autoscaler writes to a Deployment."""
    key = ("Deployment", "ns", f"llama3-8b-{role}")
    cluster.patch("apps/v1", "Deployment", "ns", key[2], r.scale_patch(cluster.objects[key], n))


def test_replicas_come_from_the_spec_never_from_status():
    # example: spec prefill 2, decode 4; autoscaling prefill 1..4, decode 2..8
    doc = example()
    doc["spec"]["decode"]["replicas"] = 20  # autoscaling on: created at the spec's number moved into min/max
    cluster = with_autoscaler_status(doc, {"prefill": {"desired": 3}, "decode": {"desired": 5}})
    run_pass(cluster)
    assert replicas(cluster) == (2, 8)
    doc = example()
    doc["spec"]["autoscaling"]["dryRun"] = True  # dry run: the spec's numbers, whatever status says
    cluster = with_autoscaler_status(doc, {"dryRun": True, "prefill": {"desired": 3}, "decode": {"desired": 5}})
    run_pass(cluster)
    assert replicas(cluster) == (2, 4)
    doc["spec"]["autoscaling"] = {"enabled": False}  # off: spec, unclamped; status.autoscaling removed
    doc["spec"]["decode"]["replicas"] = 12
    cluster = with_autoscaler_status(doc, {"prefill": {"desired": 3}, "decode": {"desired": 5}})
    run_pass(cluster)
    assert replicas(cluster) == (2, 12)
    assert "autoscaling" not in cluster.resource()["status"]
    assert next(b for v, _, b in cluster.writes if v == "patch/status")["status"]["autoscaling"] is None


def test_with_autoscaling_an_existing_deployments_replicas_are_left_alone():
    cluster = FakeCluster()
    cluster.add_resource(example())
    run_pass(cluster)
    scale(cluster, "decode", 6)  # the autoscaler
    cluster.writes.clear()
    assert (run_pass(cluster).children_written, replicas(cluster)) == ([], (2, 6))
    cluster.objects[("Deployment", "ns", "llama3-8b-decode")]["spec"]["replicas"] = 7  # kubectl scale
    result = run_pass(cluster)
    assert (result.children_written, result.replicas_reverted, replicas(cluster)) == ([], [], (2, 7))
    assert "ready: prefill 0/2, decode 0/6" in conditions_message(cluster, "Ready")  # the operator's number
    # a spec change elsewhere in the Deployment is applied without touching its replicas
    changed = cluster.resource()
    del changed["spec"]["decode"]["nodeSelector"]
    cluster.objects[(s.KIND, "ns", "llama3-8b")] = apply_merge_patch(changed, {"metadata": {"generation": 2}})
    cluster.writes.clear()
    assert run_pass(cluster).children_written == ["Deployment/llama3-8b-decode"]
    patch = next(body for verb, what, body in cluster.writes if what == "Deployment/llama3-8b-decode")
    assert "replicas" not in patch["spec"] and replicas(cluster) == (2, 7)
    dep = cluster.get("apps/v1", "Deployment", "ns", "llama3-8b-decode")
    assert r.applied_replicas(dep) == 6  # type: ignore[arg-type]


def test_with_autoscaling_a_deployment_from_an_older_operator_is_patched_without_its_replicas():
    cluster = FakeCluster()
    cluster.add_resource(example())
    run_pass(cluster)
    scale(cluster, "decode", 6)
    dep = cluster.objects[("Deployment", "ns", "llama3-8b-decode")]
    dep["metadata"]["annotations"][naming.ANNOTATION_LAST_APPLIED] = '{"metadata":{"labels":{"older":"true"}}}'
    cluster.writes.clear()
    result = run_pass(cluster)
    assert result.children_written == ["Deployment/llama3-8b-decode"] and replicas(cluster) == (2, 6)
    patch = next(body for verb, what, body in cluster.writes if what == "Deployment/llama3-8b-decode")
    assert "replicas" not in patch["spec"] and patch["metadata"]["labels"]["older"] is None
    assert "decode 0/6" in conditions_message(cluster, "Ready")


def conditions_message(cluster: FakeCluster, ctype: str) -> str:
    return next(c["message"] for c in cluster.resource()["status"]["conditions"] if c["type"] == ctype)


def test_hand_edit_is_reported_but_a_new_spec_count_is_not():
    doc = example()
    doc["spec"]["autoscaling"]["dryRun"] = True  # the spec's replicas apply
    cluster = FakeCluster()
    cluster.add_resource(doc)
    run_pass(cluster)
    cluster.objects[("Deployment", "ns", "llama3-8b-decode")]["spec"]["replicas"] = 7  # kubectl scale
    result = run_pass(cluster)
    assert result.replicas_reverted == [r.ReplicasReverted("llama3-8b-decode", 7, 4, "spec.decode.replicas")]
    assert replicas(cluster) == (2, 4)
    body = cluster.objects[(s.KIND, "ns", "llama3-8b")]
    body["spec"]["decode"]["replicas"] = 5  # the spec moves: not a hand edit
    result = run_pass(cluster)
    assert (result.replicas_reverted, replicas(cluster)) == ([], (2, 5))


def test_gone_resource_is_a_quiet_pass():
    cluster = FakeCluster()
    assert r.reconcile({"metadata": {"name": "x", "namespace": "ns"}}, cluster, T0) is None
    assert cluster.writes == []


def test_merge_patch():
    assert r.merge_patch({"a": 1, "b": {"c": 2, "d": 3}}, {"b": {"c": 2}, "e": [1]}) == \
        {"b": {"c": 2, "d": None}, "e": [1], "a": None}


# ---------------------------------------------------------------- gateway, security, ownership
def gateway_example(**gateway: Any) -> dict[str, Any]:
    doc = example()
    doc["spec"]["gateway"] = {"enabled": True, **gateway}
    return doc


def test_the_hand_off_key_is_created_once_and_never_rewritten():
    cluster = FakeCluster()
    cluster.add_resource(example())
    keys = iter(["key-one", "key-two"])
    r.reconcile(cluster.resource(), cluster, T0, new_key=lambda: next(keys))
    secret = cluster.get("v1", "Secret", "ns", "llama3-8b-handoff")
    assert secret["data"] == {"key": "a2V5LW9uZQ=="}  # base64("key-one")
    assert secret["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    cluster.writes.clear()
    r.reconcile(cluster.resource(), cluster, T0, new_key=lambda: next(keys))
    assert cluster.writes == [] and cluster.get("v1", "Secret", "ns", "llama3-8b-handoff") == secret
    # the user's own Secret: none is created
    doc = example()
    doc["spec"]["security"] = {"handoffKeySecret": {"name": "mine"}}
    own = FakeCluster()
    own.add_resource(doc)
    run_pass(own)
    assert not [k for k in own.objects if k[0] == "Secret"]


def test_the_gateway_adds_its_children_reports_the_pool_and_removes_them_when_turned_off():
    cluster = FakeCluster()
    cluster.add_resource(gateway_example(httpRoute={"gatewayName": "gw"}))
    first = run_pass(cluster)
    assert {"InferencePool/llama3-8b", "HTTPRoute/llama3-8b", "Deployment/llama3-8b-epp", "Service/llama3-8b-epp",
            "ServiceAccount/llama3-8b-worker", "NetworkPolicy/llama3-8b-epp"} <= set(first.children_written)
    cluster.finish_rollouts()
    run_pass(cluster)
    status = cluster.resource()["status"]
    assert status["endpointPicker"] == {"replicas": 1, "readyReplicas": 1, "updatedReplicas": 1}
    assert conditions(cluster.resource())["Ready"] == ("True", "ReplicasReady")
    assert conditions(cluster.resource())["InferencePoolReady"] == ("Unknown", "WaitingForGateway")
    # the user's gateway controller accepts the pool
    pool = cluster.objects[("InferencePool", "ns", "llama3-8b")]
    accepted = {"type": "Accepted", "status": "True", "reason": "Accepted"}
    pool["status"] = {"parents": [{"parentRef": {"name": "gw"}, "conditions": [
        accepted, {"type": "ResolvedRefs", "status": "False", "reason": "InvalidExtensionRef", "message": "no"}]}]}
    run_pass(cluster)
    assert conditions(cluster.resource())["InferencePoolReady"] == ("False", "InvalidExtensionRef")
    pool["status"]["parents"][0]["conditions"][1] = {"type": "ResolvedRefs", "status": "True", "reason": "R"}
    run_pass(cluster)
    assert conditions(cluster.resource())["InferencePoolReady"] == ("True", "Accepted")
    # the endpoint picker's readiness is the resource's
    cluster.objects[("Deployment", "ns", "llama3-8b-epp")]["status"]["readyReplicas"] = 0
    run_pass(cluster)
    assert conditions(cluster.resource())["Degraded"] == ("True", "ReplicasUnavailable")
    # off: its children go, and so do its status and condition
    body = cluster.objects[(s.KIND, "ns", "llama3-8b")]
    body["spec"]["gateway"] = {"enabled": False}
    result = run_pass(cluster)
    assert sorted(result.children_removed) == sorted([
        "NetworkPolicy/llama3-8b-epp", "ServiceAccount/llama3-8b-worker", "Role/llama3-8b-worker",
        "RoleBinding/llama3-8b-worker", "ServiceAccount/llama3-8b-epp", "Role/llama3-8b-epp",
        "RoleBinding/llama3-8b-epp", "Service/llama3-8b-epp", "Deployment/llama3-8b-epp",
        "InferencePool/llama3-8b", "HTTPRoute/llama3-8b"])
    assert not [k for k in cluster.objects if k[0] in ("InferencePool", "HTTPRoute") or k[2].endswith("-epp")]
    status = cluster.resource()["status"]
    assert "endpointPicker" not in status and "InferencePoolReady" not in conditions(cluster.resource())
    cluster.writes.clear()
    assert run_pass(cluster).children_removed == [] and cluster.writes == []


def test_turning_network_policies_off_removes_only_ours():
    cluster = FakeCluster()
    cluster.add_resource(example())
    run_pass(cluster)
    theirs = {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
              "metadata": {"name": "llama3-8b-epp", "namespace": "ns"}}  # someone else's, no owner
    cluster.objects[("NetworkPolicy", "ns", "llama3-8b-epp")] = theirs
    cluster.objects[(s.KIND, "ns", "llama3-8b")]["spec"]["security"] = {"networkPolicy": {"enabled": False}}
    result = run_pass(cluster)
    assert sorted(result.children_removed) == ["NetworkPolicy/llama3-8b-decode", "NetworkPolicy/llama3-8b-prefill",
                                               "NetworkPolicy/llama3-8b-router"]
    assert cluster.get("networking.k8s.io/v1", "NetworkPolicy", "ns", "llama3-8b-epp") == theirs


def test_an_object_another_controller_owns_is_not_adopted():
    cluster = FakeCluster()
    cluster.add_resource(example())
    foreign = {"apiVersion": "v1", "kind": "Service", "metadata": {
        "name": "llama3-8b", "namespace": "ns", "labels": {"app": "theirs"},
        "ownerReferences": [{"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "theirs", "uid": "x",
                             "controller": True}]}, "spec": {"selector": {"app": "theirs"}}}
    cluster.objects[("Service", "ns", "llama3-8b")] = copy.deepcopy(foreign)
    result = run_pass(cluster)
    assert [str(c) for c in result.conflicts] == ["Service llama3-8b is controlled by StatefulSet theirs"]
    assert "Service/llama3-8b" not in result.children_written
    assert cluster.get("v1", "Service", "ns", "llama3-8b") == foreign  # not patched
    assert conditions(cluster.resource())["Degraded"] == ("True", "ChildOwnedElsewhere")
    assert "StatefulSet theirs" in conditions_message(cluster, "Ready")
    # a Deployment owned elsewhere counts as not there
    cluster.finish_rollouts()
    dep = cluster.objects[("Deployment", "ns", "llama3-8b-decode")]
    dep["metadata"]["ownerReferences"] = [{"kind": "Other", "name": "o", "uid": "y", "controller": True}]
    result = run_pass(cluster)
    assert {c.name for c in result.conflicts} == {"llama3-8b", "llama3-8b-decode"}
    assert cluster.resource()["status"]["decode"]["readyReplicas"] == 0
    # an object without a controller keeps today's behaviour: adopted (patched, our owner reference)
    cluster.objects[("Service", "ns", "llama3-8b")]["metadata"]["ownerReferences"] = []
    dep["metadata"]["ownerReferences"] = [{"kind": "Other", "name": "o", "uid": "y"}]  # owner, not controller
    result = run_pass(cluster)
    assert result.conflicts == [] and "Service/llama3-8b" in result.children_written
    svc = cluster.get("v1", "Service", "ns", "llama3-8b")
    assert svc["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    assert conditions(cluster.resource())["Degraded"][1] != "ChildOwnedElsewhere"
