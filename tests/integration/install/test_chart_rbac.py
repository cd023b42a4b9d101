"""The chart's RBAC is exactly what the operator uses.

For each install scope (all namespaces, listed namespaces, each with and without peering), render the chart with
a real helm, run the operator with the rendered container args (the Dockerfile's entrypoint + `args`) against the
operator tests' emulated API server, drive a create / readiness / autoscaling (up, then down with the
pod-deletion-cost mark) / update / gateway and NetworkPolicies turned off / invalid spec / delete scenario (the
resource starts with spec.gateway and an HTTPRoute on), and compare the API server's request log with the rendered
(Cluster)Roles and bindings:
(a) every request the operator made is allowed for the operator's ServiceAccount, in the namespace it was made in;
(b) every granted (group, resource, verb) was requested, or is needed to grant the router's Role (Kubernetes'
    escalation check: the operator can only create a Role with rules it holds itself); a cluster-wide grant in a
    namespaced install must be used cluster-wide.
Discovery (/api, /apis) is not in any rule: every authenticated user may read it (system:discovery).
"""
from __future__ import annotations

import copy
import json
import os
import re
import signal
import subprocess
import sys
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[3]
CHART = ROOT / "charts" / "disagg-operator"
OPERATOR_TESTS = ROOT / "tests" / "integration" / "operator"
if str(OPERATOR_TESTS) not in sys.path:  # the operator tests' emulator and harness (tests/: tests/conftest.py)
    sys.path.insert(0, str(OPERATOR_TESTS))

from emulator import EmulatorThread, Kind, RecordedRequest  # noqa: E402
from fake_worker import FakeWorker  # noqa: E402
from helm_cli import template  # noqa: E402
from operator_harness import CR, EXAMPLES  # noqa: E402
from waiting import wait_for  # noqa: E402

from disagg.operator.autoscaling import cluster as sc  # noqa: E402
from disagg.operator import manifests as m  # noqa: E402
from disagg.operator import spec as s  # noqa: E402
from disagg.operator import naming  # noqa: E402
from disagg.worker.local.process import free_port  # noqa: E402

DRIVER = "chart-rbac-test"  # fieldManager of the test's own requests: everything else is the operator's
RELEASE_NS = "disagg-system"
# the children the operator patches (the Secret is created once, never patched)
CHILD_KINDS = [("apps", "v1", "deployments"), ("", "v1", "services"), ("", "v1", "serviceaccounts"),
               ("rbac.authorization.k8s.io", "v1", "roles"), ("rbac.authorization.k8s.io", "v1", "rolebindings"),
               ("networking.k8s.io", "v1", "networkpolicies"), ("inference.networking.k8s.io", "v1", "inferencepools"),
               ("gateway.networking.k8s.io", "v1", "httproutes")]
GATEWAY_KINDS = {
    ("inference.networking.k8s.io", "v1", "inferencepools"): Kind("InferencePool", status_subresource=True),
    ("gateway.networking.k8s.io", "v1", "httproutes"): Kind("HTTPRoute", status_subresource=True)}
PEERING_KINDS = {("kopf.dev", "v1", "kopfpeerings"): Kind("KopfPeering"),
                 ("kopf.dev", "v1", "clusterkopfpeerings"): Kind("ClusterKopfPeering", namespaced=False)}
SCENARIOS = {  # name -> helm values arguments
    "all-namespaces": [],
    "namespaced": ["-f", CHART / "ci" / "namespaced-values.yaml"],
    "all-namespaces-peering": ["-f", CHART / "ci" / "peering-values.yaml"],
    "namespaced-peering": ["-f", CHART / "ci" / "namespaced-peering-values.yaml"],
}


@dataclass(frozen=True)
class Grant:
    group: str
    resource: str
    verb: str
    namespace: str | None  # None: cluster-wide (ClusterRoleBinding)


# ---------------------------------------------------------------- the chart's rules
def service_account(docs: list[dict]) -> tuple[str, str]:
    sa = next(d for d in docs if d["kind"] == "ServiceAccount")
    return sa["metadata"]["name"], sa["metadata"]["namespace"]


def granted(docs: list[dict]) -> set[Grant]:
    """What the rendered bindings give the operator's ServiceAccount."""
    sa_name, sa_ns = service_account(docs)
    roles = {(d["kind"], d["metadata"].get("namespace"), d["metadata"]["name"]): d.get("rules") or []
             for d in docs if d["kind"] in ("Role", "ClusterRole")}
    out: set[Grant] = set()
    for b in (d for d in docs if d["kind"] in ("RoleBinding", "ClusterRoleBinding")):
        if not any(sub == {"kind": "ServiceAccount", "name": sa_name, "namespace": sa_ns} for sub in b["subjects"]):
            continue
        ns = b["metadata"]["namespace"] if b["kind"] == "RoleBinding" else None
        ref = b["roleRef"]
        rules = roles[(ref["kind"], ns if ref["kind"] == "Role" else None, ref["name"])]
        for rule in rules:
            assert not {"resourceNames", "nonResourceURLs"} & rule.keys(), rule
            for group in rule["apiGroups"]:
                for resource in rule["resources"]:
                    for verb in rule["verbs"]:
                        assert "*" not in (group, resource, verb), f"wildcard in {b['metadata']['name']}: {rule}"
                        out.add(Grant(group, resource, verb, ns))
    return out


def request_namespace(r: RecordedRequest) -> str | None:
    if r.resource == "namespaces":
        return None
    m = re.search(r"/namespaces/([^/]+)/", r.path)
    return m.group(1) if m else None


def allowed(r: RecordedRequest, grants: set[Grant]) -> bool:
    ns = request_namespace(r)
    return any((g.group, g.resource, g.verb) == (r.group or "", r.resource, r.verb) and g.namespace in (None, ns)
               for g in grants)


def escalation_rules(requests: list[RecordedRequest]) -> set[tuple[str, str, str]]:
    """Rules of the Roles the operator created: it must hold them itself to create them."""
    return {(group, resource, verb)
            for r in requests if r.verb in ("create", "patch") and r.resource == "roles" and isinstance(r.body, dict)
            for rule in r.body.get("rules") or []
            for group in rule["apiGroups"] for resource in rule["resources"] for verb in rule["verbs"]}


# ---------------------------------------------------------------- running the rendered operator
def operator_command(docs: list[dict], pod_index: int) -> list[str]:
    """The image's entrypoint + the rendered args, with $(VAR) expanded as the kubelet would."""
    dockerfile = (ROOT / "Dockerfile").read_text()
    entrypoint = json.loads(re.search(r"AS operator\b.*?^ENTRYPOINT (\[.*?\])", dockerfile, re.S | re.M).group(1))
    assert entrypoint[0] == "disagg"  # the console script: disagg.worker.cli:main
    workload = next(d for d in docs if d["kind"] in ("Deployment", "StatefulSet"))
    container = workload["spec"]["template"]["spec"]["containers"][0]
    env: dict[str, str] = {}
    for var in container.get("env") or []:
        field = (var.get("valueFrom") or {}).get("fieldRef", {}).get("fieldPath")
        env[var["name"]] = str(pod_index) if field == "metadata.labels['apps.kubernetes.io/pod-index']" \
            else var["value"]
    args = [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in container["args"]]
    return [sys.executable, "-m", "disagg.worker.cli", *entrypoint[1:], *args]


def served_namespaces(command: list[str]) -> list[str]:
    return [command[i + 1] for i, a in enumerate(command) if a == "--namespace"]


class Driver:
    """The test's own requests (tagged with fieldManager=DRIVER) and reads straight from the emulator's store."""

    def __init__(self, api: EmulatorThread):
        self.api, self.store = api, api.emulator

    def send(self, method: str, path: str, body: Any = None, merge: bool = False) -> None:
        headers = {"Content-Type": "application/merge-patch+json"} if merge else {}
        with self.api.client() as http:
            http.request(method, path, params={"fieldManager": DRIVER}, json=body, headers=headers).raise_for_status()

    def cr_path(self, ns: str, name: str | None = None) -> str:
        return f"/apis/{CR[0]}/{CR[1]}/namespaces/{ns}/{CR[2]}" + (f"/{name}" if name else "")

    def deployments(self, ns: str) -> list[dict]:
        return self.store.list_objects("apps", "v1", "deployments", ns)

    @staticmethod
    def object_path(key: tuple[str, str, str], ns: str, name: str) -> str:
        group, version, plural = key
        return f"{'/apis/' + group if group else '/api'}/{version}/namespaces/{ns}/{plural}/{name}"

    def children(self, ns: str) -> list[tuple[tuple[str, str, str], dict]]:
        return [(key, obj) for key in CHILD_KINDS for obj in self.store.list_objects(*key, ns)]

    def condition(self, ns: str, name: str, ctype: str) -> str | None:
        obj = self.store.get_object(*CR, ns, name) or {}
        return next((c["status"] for c in (obj.get("status") or {}).get("conditions", []) if c["type"] == ctype),
                    None)

    def replicas(self, ns: str, name: str, role: str) -> int | None:
        dep = self.store.get_object("apps", "v1", "deployments", ns, f"{name}-{role}")
        return dep["spec"]["replicas"] if dep else None

    def deletion_cost_marked(self, ns: str) -> list[str]:
        return sorted(p["metadata"]["name"] for p in self.store.list_objects("", "v1", "pods", ns)
                      if naming.ANNOTATION_DELETION_COST in (p["metadata"].get("annotations") or {}))

    def play_deployment_controller(self, ns: str) -> None:
        for dep in self.deployments(ns):
            n = dep["spec"]["replicas"]
            self.send("PATCH", f"/apis/apps/v1/namespaces/{ns}/deployments/{dep['metadata']['name']}/status",
                      {"status": {"observedGeneration": dep["metadata"]["generation"], "replicas": n,
                                  "updatedReplicas": n, "readyReplicas": n, "availableReplicas": n}}, merge=True)


def autoscaling_example(example: dict[str, Any]) -> dict[str, Any]:
    """The example with a fast, deterministic autoscaler: decode between 2 and 3 replicas, prefill fixed at 1, no
    stabilization windows, the default targets (decode KV-cache usage 80 %, 4 waiting requests per prefill pod)."""
    doc = copy.deepcopy(example)
    doc["spec"]["prefill"]["replicas"], doc["spec"]["decode"]["replicas"] = 1, 2
    doc["spec"]["autoscaling"] = {"enabled": True, "intervalSeconds": 1,
                                  "prefill": {"minReplicas": 1, "maxReplicas": 1},
                                  "decode": {"minReplicas": 2, "maxReplicas": 3},
                                  "stabilization": {"scaleUpSeconds": 0, "scaleDownSeconds": 0}}
    return doc


class WorkerPods:
    """Running, ready worker Pods as a ReplicaSet would create them, each with a fake worker on 127.0.0.1 serving
    its /metrics (found by the operator through podIP + the disagg.dev/metrics-port annotation)."""

    def __init__(self, d: Driver, ns: str, name: str):
        self.d, self.ns, self.name = d, ns, name
        self.workers: dict[str, FakeWorker] = {}  # pod name -> its metrics

    def add(self, role: m.Role, **load: Any) -> str:
        worker = FakeWorker(role)
        worker.set(**load)
        pod = f"{self.name}-{role}-{worker.port}"
        self.workers[pod] = worker
        labels = naming.selector_labels(self.name, role)
        self.d.send("POST", f"/api/v1/namespaces/{self.ns}/pods", {
            "metadata": {"name": pod, "labels": labels,
                         "annotations": {naming.ANNOTATION_METRICS_PORT: str(worker.port)}},
            "spec": {"containers": [{"name": role, "image": "x"}]}})
        self.d.send("PATCH", f"/api/v1/namespaces/{self.ns}/pods/{pod}/status", {"status": {
            "phase": "Running", "podIP": "127.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]}},
            merge=True)
        return pod

    def remove(self, pod: str) -> None:
        self.d.send("DELETE", f"/api/v1/namespaces/{self.ns}/pods/{pod}")
        self.workers.pop(pod).stop()

    def stop(self) -> None:
        for worker in self.workers.values():
            worker.stop()


def scale_up_and_down(d: Driver, ns: str, name: str, pods: WorkerPods) -> None:
    """Decode over its KV-cache target scales up 2 -> 3; once idle it scales down 3 -> 2 after the operator marked
    the least-loaded pod with pod-deletion-cost (lists pods, scrapes them, patches one)."""
    pods.add("prefill")
    busy = [pods.add("decode", kv_cache_usage=0.95, running=4) for _ in range(2)]
    wait_for(lambda: d.replicas(ns, name, "decode") == 3, 20, "decode scaled up to 3")
    idle = pods.add("decode")  # the ReplicaSet's third pod: mean usage 63 % keeps 3 (ceil(3 x 63/80))
    for pod in busy:
        pods.workers[pod].set(kv_cache_usage=0.1, running=4)
    assert wait_for(lambda: d.deletion_cost_marked(ns), 20, "a pod marked for deletion") == [idle]
    wait_for(lambda: d.replicas(ns, name, "decode") == 2, 10, "decode scaled down to 2")
    pods.remove(idle)  # what the ReplicaSet removes first


def drive(d: Driver, ns: str, example: dict[str, Any]) -> None:
    """Create (gateway on), readiness, autoscaling, update, the gateway and NetworkPolicies off (deletions), an
    invalid spec (an Event), deletion (finalizers removed)."""
    name = example["metadata"]["name"]
    d.send("POST", d.cr_path(ns), example)
    wait_for(lambda: len(d.deployments(ns)) == 4, 20, "the four Deployments (the endpoint picker's too)")
    d.play_deployment_controller(ns)
    wait_for(lambda: d.condition(ns, name, "Ready") == "True", 10, "Ready=True")
    pods = WorkerPods(d, ns, name)
    try:
        scale_up_and_down(d, ns, name, pods)
        update_upgrade_break_delete(d, ns, name, example)
    finally:
        pods.stop()


def update_upgrade_break_delete(d: Driver, ns: str, name: str, example: dict[str, Any]) -> None:
    """A new image, children from an older operator version, an invalid spec, deletion."""
    d.send("PATCH", d.cr_path(ns, name), {"spec": {"image": "example/disagg-worker:0.2.0"}}, merge=True)
    wait_for(lambda: all(dep["spec"]["template"]["spec"]["containers"][0]["image"].endswith("0.2.0")
                         for dep in d.deployments(ns)), 10, "the new image rolled out")
    # children written by an older operator version (another last-applied state): an upgrade patches every kind
    old = json.dumps({"metadata": {"labels": {"older-operator": "true"}}})
    for key, obj in d.children(ns):
        d.send("PATCH", d.object_path(key, ns, obj["metadata"]["name"]),
               {"metadata": {"annotations": {naming.ANNOTATION_LAST_APPLIED: old}}}, merge=True)
    wait_for(lambda: all(obj["metadata"]["annotations"][naming.ANNOTATION_LAST_APPLIED] != old
                         for _, obj in d.children(ns)), 10, "every child patched to the current manifests")
    # the gateway and the NetworkPolicies turned off: the operator deletes their children
    d.send("PATCH", d.cr_path(ns, name), {"spec": {"gateway": None, "security": {"networkPolicy": {
        "enabled": False}}}}, merge=True)
    wait_for(lambda: not [obj for key, obj in d.children(ns) if key in GATEWAY_KINDS or key[2] ==
                          "networkpolicies" or obj["metadata"]["name"].endswith(("-epp", "-worker"))],
             10, "the gateway's children and the NetworkPolicies deleted")
    broken = copy.deepcopy(example)
    broken["metadata"]["name"] = "broken"
    broken["spec"]["autoscaling"]["decode"] = {"minReplicas": 6, "maxReplicas": 2}
    d.send("POST", d.cr_path(ns), broken)
    wait_for(lambda: any(e.get("reason") == "InvalidSpec" for e in d.store.list_objects("", "v1", "events", ns)),
             10, "an InvalidSpec Event")
    for gone in (name, "broken"):
        d.send("DELETE", d.cr_path(ns, gone))
    wait_for(lambda: not d.store.list_objects(*CR, ns), 10, "finalizers removed")


def run_operator(docs: list[dict], liveness_port: int, metrics_port: int, example: dict[str, Any],
                 tmp_path: Path) -> list[RecordedRequest]:
    """Run the rendered operator through the scenario; returns the operator's requests."""
    command = operator_command(docs, pod_index=1)
    serving = served_namespaces(command)
    with EmulatorThread() as api:
        api.emulator.declare(*CR, Kind(s.KIND, status_subresource=True, short_names=tuple(s.SHORT_NAMES)))
        for key, kind in {**PEERING_KINDS, **GATEWAY_KINDS}.items():
            api.emulator.declare(*key, kind)
        d = Driver(api)
        for ns in {RELEASE_NS, "default", *serving}:
            d.send("POST", "/api/v1/namespaces", {"metadata": {"name": ns}})
        for peering in (doc for doc in docs if doc["apiVersion"] == "kopf.dev/v1"):  # the chart creates these
            ns = peering["metadata"].get("namespace")
            plural = "kopfpeerings" if ns else "clusterkopfpeerings"
            d.send("POST", f"/apis/kopf.dev/v1/{f'namespaces/{ns}/' if ns else ''}{plural}", peering)
        kubeconfig = tmp_path / "kubeconfig.yaml"
        kubeconfig.write_text(yaml.safe_dump(api.kubeconfig(namespace=RELEASE_NS)))
        env = {k: v for k, v in os.environ.items() if k != "KUBERNETES_SERVICE_HOST"}
        env["KUBECONFIG"] = str(kubeconfig)
        # a file, not a pipe: nothing reads a pipe until the end, and an operator blocked on a full one stalls
        log_path = tmp_path / "operator.log"
        log = log_path.open("w")
        proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
        try:
            drive(d, (serving or ["default"])[0], example)
            probe = wait_for(lambda: _get(f"http://127.0.0.1:{liveness_port}/healthz"), 10, "kopf's liveness")
            assert probe == 200
            # the chart's metrics.* values: the operator's own metrics saw both decisions
            decisions = {(smp.labels["role"], smp.labels["reason"])
                         for family in text_string_to_metric_families(
                             _get_text(f"http://127.0.0.1:{metrics_port}/metrics"))
                         for smp in family.samples if smp.name == "disagg_operator_scaling_decisions_total"}
            assert {("decode", "DecodeBound"), ("decode", "Underutilized")} <= decisions, decisions
            for key in PEERING_KINDS:  # with peering, this replica announces itself with its pod-index priority
                for peering in api.emulator.list_objects(*key):
                    assert [p["priority"] for p in (peering.get("status") or {}).values()] == [1], peering
            assert proc.poll() is None, "operator exited"
        finally:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                raise
            finally:
                log.close()
        assert proc.returncode == 0, log_path.read_text()[-4000:]
        return [r for r in api.emulator.requests if r.query.get("fieldManager") != DRIVER]


def _get_text(url: str) -> str:
    with urllib.request.urlopen(url, timeout=2) as rsp:
        return rsp.read().decode()


def _get(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as rsp:
            return rsp.status
    except OSError:
        return None


# ---------------------------------------------------------------- the test
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_rbac_allows_every_operator_request_and_grants_nothing_unused(scenario, tmp_path):
    port, metrics_port = free_port(), free_port()
    docs = template(CHART, tmp_path / "helm", *SCENARIOS[scenario], "--set-json", "resyncSeconds=0.3",
                    "--set", f"livenessPort={port}", "--set", "metrics.enabled=true",
                    "--set", f"metrics.port={metrics_port}", namespace=RELEASE_NS)
    example = autoscaling_example(yaml.safe_load((EXAMPLES / "llama3-8b-gpu.yaml").read_text()))
    example["spec"]["gateway"] = {"enabled": True, "httpRoute": {"gatewayName": "inference-gw"}}
    requests = run_operator(docs, port, metrics_port, example, tmp_path)
    api_requests = [r for r in requests if r.verb and r.resource]
    grants = granted(docs)

    denied = sorted({(r.verb, r.group or "core", r.resource, request_namespace(r) or "-")
                     for r in api_requests if not allowed(r, grants)})
    assert not denied, f"the chart does not allow these operator requests (verb, group, resource, ns): {denied}"

    used = {(r.group or "", r.resource, r.verb) for r in api_requests}
    escalation = escalation_rules(requests)
    assert escalation, "the operator created no Role: the scenario did not exercise the router's RBAC"
    unused = sorted({(g.group or "core", g.resource, g.verb) for g in grants} -
                    {(g or "core", r, v) for g, r, v in used | escalation})
    assert not unused, f"the chart grants what the operator never requested: {unused}"

    if served_namespaces(operator_command(docs, 0)):  # a namespaced install: cluster-wide only where needed
        used_cluster_wide = {(r.group or "", r.resource, r.verb) for r in api_requests if request_namespace(r) is None}
        too_wide = sorted((g.group or "core", g.resource, g.verb) for g in grants
                          if g.namespace is None and (g.group, g.resource, g.verb) not in used_cluster_wide)
        assert not too_wide, f"granted cluster-wide but used only in namespaces: {too_wide}"
    print(f"\nRBAC {scenario}: {len(api_requests)} requests, all allowed; granted = used "
          f"{sorted(used)} + escalation {sorted(escalation)}")
