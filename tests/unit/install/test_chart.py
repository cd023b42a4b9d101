"""The Helm chart, rendered by a real helm (tests/helm_cli.py): lint, schema-valid manifests, secure defaults,
documented values, and the ties to the code (CRD copy, operator flags, worker labels and ports, kopf's peering).

Built-in kinds are validated with kubernetes-validate --strict (unknown fields rejected) for the oldest supported
Kubernetes (Chart.yaml kubeVersion) and the newest it knows. Custom resources are not in its schemas: KopfPeering
objects are validated against the chart's own peering CRD schema, the PodMonitor structurally against the
labels and ports the operator really gives worker pods (the prometheus-operator CRD is not available offline).
"""
from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from openapi_schema_validator import OAS30Validator

from helm_cli import run_helm, template  # tests/ is on sys.path (tests/conftest.py)
from prometheus_cli import sanitized

ROOT = Path(__file__).resolve().parents[3]

from disagg.operator import cli as operator_cli  # noqa: E402
from disagg.operator import manifests as m  # noqa: E402
from disagg.operator import spec as s  # noqa: E402
from disagg.operator import naming  # noqa: E402

CHART = ROOT / "charts" / "disagg-operator"
SCENARIOS = ["default", *sorted(p.name for p in (CHART / "ci").glob("*-values.yaml"))]
OLDEST = re.search(r'kubeVersion: ">=(\d+\.\d+)', (CHART / "Chart.yaml").read_text()).group(1)
K8S_VERSIONS = [OLDEST, kubernetes_validate.latest_version()]
CUSTOM_GROUPS = ("kopf.dev/", "monitoring.coreos.com/", "disagg.dev/")


def values_args(scenario: str) -> list[str | Path]:
    return [] if scenario == "default" else ["-f", CHART / "ci" / scenario]


@pytest.fixture(scope="module")
def helm_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("helm")


@pytest.fixture(scope="module")
def render(helm_home: Path):
    def render(*args: str | Path) -> list[dict[str, Any]]:
        return template(CHART, helm_home, *args)
    return render


def by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def workload(docs: list[dict]) -> dict:
    (w,) = [d for d in docs if d["kind"] in ("Deployment", "StatefulSet")]
    return w


def container(docs: list[dict]) -> dict:
    (c,) = workload(docs)["spec"]["template"]["spec"]["containers"]
    return c


def parse_operator_args(args: list[str]) -> argparse.Namespace:
    """The container args through `disagg operator`'s own parser ($(VAR)s as the kubelet expands them)."""
    parser = argparse.ArgumentParser(prog="disagg operator", exit_on_error=False)
    operator_cli.add_arguments(parser)
    return parser.parse_args([re.sub(r"\$\(\w+\)", "1", a) for a in args])


# ---------------------------------------------------------------- files and helm
def test_chart_crd_is_the_generated_crd():
    chart_copy = CHART / "crds" / "disaggregatedinferences.disagg.dev.yaml"
    assert chart_copy.read_bytes() == (ROOT / "crds" / "disaggregatedinferences.disagg.dev.yaml").read_bytes(), \
        "charts/disagg-operator/crds/ drifted from crds/: run `disagg crd` (it writes both)"


def test_peering_crds_are_the_resources_kopf_uses():
    from kopf._cogs.structs import references
    crds = {(c["spec"]["group"], c["spec"]["versions"][0]["name"], c["spec"]["names"]["plural"]): c
            for c in (yaml.safe_load(p.read_text()) for p in (CHART / "crds").glob("*kopf*.yaml"))}
    cluster, namespaced = references.CLUSTER_PEERINGS_K, references.NAMESPACED_PEERINGS_K
    assert set(crds) == {(sel.group, sel.version, sel.any_name) for sel in (cluster, namespaced)}
    assert crds[(cluster.group, cluster.version, cluster.any_name)]["spec"]["scope"] == "Cluster"
    assert crds[(namespaced.group, namespaced.version, namespaced.any_name)]["spec"]["scope"] == "Namespaced"


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_helm_lint_strict(scenario, helm_home):
    proc = run_helm("lint", "--strict", CHART, *values_args(scenario), home=helm_home, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_rendered_manifests_are_valid(scenario, render):
    docs = render("--include-crds", *values_args(scenario))
    crd_schemas = {(c["spec"]["group"], c["spec"]["names"]["kind"]): c["spec"]["versions"][0]["schema"]
                   for c in by_kind(docs, "CustomResourceDefinition")}
    for doc in docs:
        if doc["apiVersion"].startswith(CUSTOM_GROUPS):
            if doc["kind"] in ("KopfPeering", "ClusterKopfPeering"):
                OAS30Validator(crd_schemas[("kopf.dev", doc["kind"])]["openAPIV3Schema"]).validate(doc)
            else:
                # PrometheusRule: tests/unit/install/test_monitoring.py (promtool)
                assert doc["kind"] in ("PodMonitor", "PrometheusRule"), f"unexpected custom resource {doc['kind']}"
            continue
        for version in K8S_VERSIONS:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                pytest.fail(f"{doc['kind']}/{doc['metadata']['name']} invalid for Kubernetes {version}: {e.message}"
                            f" at {list(e.path)}")


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_container_args_are_accepted_by_disagg_operator(scenario, render):
    docs = render(*values_args(scenario))
    args = parse_operator_args(container(docs)["args"])
    namespaces = yaml.safe_load((CHART / "ci" / scenario).read_text()).get("watchNamespaces", []) \
        if scenario != "default" else []
    assert args.namespace == namespaces and args.all_namespaces == (not namespaces)
    assert (args.peering is not None) == (workload(docs)["spec"]["replicas"] > 1)


@pytest.mark.parametrize("bad", [
    ["--set", "logLevel=LOUD"],
    ["--set", "replicaCount=0"],
    ["--set", "watchNamespaces[0]=team-*"],  # RBAC is bound per namespace: no globs
    ["--set", "unknownKey=1"],
    ["--set", "image.pullPolicy=Sometimes"],
    ["--set", "monitoring.workers.podMonitor.interval=often"],
    ["--set", "monitoring.operator.podMonitor.interval=often"],
    ["--set", "metrics.port=0"],
    ["--set", "monitoring.operator.podMonitor.enabled=true"],  # without metrics.enabled: nothing to scrape
])
def test_schema_rejects_bad_values(bad, helm_home):
    proc = run_helm("template", "x", CHART, *bad, home=helm_home, check=False)
    assert proc.returncode != 0 and "schema" in proc.stderr, proc.stderr


# ---------------------------------------------------------------- defaults
def test_default_operator_is_standalone_least_privileged_and_non_root(render):
    docs = render()
    w = workload(docs)
    pod = w["spec"]["template"]["spec"]
    c = container(docs)
    assert w["kind"] == "Deployment" and w["spec"]["replicas"] == 1
    assert w["spec"]["strategy"] == {"type": "Recreate"}, "two standalone operators must never overlap"
    args = parse_operator_args(c["args"])
    assert args.all_namespaces and args.peering is None and args.standalone
    assert args.metrics_port == 0 and [p["name"] for p in c["ports"]] == ["liveness"], "metrics are off"
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == 10001, "the Dockerfile's non-root user"
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert c["securityContext"] == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                    "capabilities": {"drop": ["ALL"]}}
    assert "resources" not in c, "resources are unset by default"
    tmp = next(v for v in pod["volumes"] if v["name"] == "tmp")
    assert "emptyDir" in tmp and {"name": "tmp", "mountPath": "/tmp"} in c["volumeMounts"]
    assert pod["serviceAccountName"] == by_kind(docs, "ServiceAccount")[0]["metadata"]["name"]
    # optional features off: no monitoring, no peering objects
    assert not [d for d in docs if d["apiVersion"].startswith(("monitoring.coreos.com/", "kopf.dev/"))]


def test_liveness_probe_calls_kopfs_liveness_endpoint(render):
    c = container(render("--set", "livenessPort=9090"))
    url = parse_operator_args(c["args"]).liveness
    port = next(p for p in c["ports"] if p["name"] == c["livenessProbe"]["httpGet"]["port"])
    assert url == f"http://0.0.0.0:{port['containerPort']}{c['livenessProbe']['httpGet']['path']}" \
        == "http://0.0.0.0:9090/healthz"


def test_cluster_wide_install_binds_one_cluster_role(render):
    docs = render()
    (binding,) = by_kind(docs, "ClusterRoleBinding")
    assert binding["roleRef"]["name"] == by_kind(docs, "ClusterRole")[0]["metadata"]["name"]
    assert not by_kind(docs, "RoleBinding") and len(by_kind(docs, "ClusterRole")) == 1


def test_namespaced_install_binds_rules_per_namespace(render):
    docs = render("-f", CHART / "ci" / "namespaced-values.yaml")
    fullname = workload(docs)["metadata"]["name"]
    namespaced_rules = next(r for r in by_kind(docs, "ClusterRole") if r["metadata"]["name"] == fullname)
    assert {b["metadata"]["namespace"] for b in by_kind(docs, "RoleBinding")} == {"team-a", "team-b"}
    assert all(b["roleRef"]["name"] == fullname for b in by_kind(docs, "RoleBinding"))
    cluster_bound = {b["roleRef"]["name"] for b in by_kind(docs, "ClusterRoleBinding")}
    assert namespaced_rules["metadata"]["name"] not in cluster_bound
    (cluster_role,) = [r for r in by_kind(docs, "ClusterRole") if r["metadata"]["name"] in cluster_bound]
    assert cluster_role["rules"] == [{"apiGroups": [""], "resources": ["namespaces"], "verbs": ["list", "watch"]}]


@pytest.mark.parametrize("values, peering_kind, namespaces", [
    ("peering-values.yaml", "ClusterKopfPeering", [None]),
    ("namespaced-peering-values.yaml", "KopfPeering", ["team-a", "team-b"]),
])
def test_replicas_coordinate_through_kopf_peering(values, peering_kind, namespaces, render):
    docs = render("-f", CHART / "ci" / values)
    w = workload(docs)
    c = container(docs)
    assert w["kind"] == "StatefulSet" and w["spec"]["replicas"] > 1
    args = parse_operator_args(c["args"])
    peerings = by_kind(docs, peering_kind)
    assert [p["metadata"].get("namespace") for p in peerings] == namespaces
    assert {p["metadata"]["name"] for p in peerings} == {args.peering}
    # replicas of one priority all pause: each pod's priority is its StatefulSet ordinal
    assert c["args"][c["args"].index("--priority") + 1] == "$(PEERING_PRIORITY)"
    assert {"name": "PEERING_PRIORITY", "valueFrom": {"fieldRef": {
        "fieldPath": "metadata.labels['apps.kubernetes.io/pod-index']"}}} in c["env"]


def test_rbac_and_service_account_can_be_brought_by_the_admin(render):
    docs = render("--set", "rbac.create=false", "--set", "serviceAccount.create=false",
                  "--set", "serviceAccount.name=ops")
    assert not [d for d in docs if d["apiVersion"].startswith("rbac.authorization.k8s.io/")]
    assert not by_kind(docs, "ServiceAccount")
    assert workload(docs)["spec"]["template"]["spec"]["serviceAccountName"] == "ops"


# ---------------------------------------------------------------- monitoring
def worker_pod_templates(example_file: str = "llama3-8b-gpu.yaml") -> list[dict]:
    """The pod templates of the Deployments the operator makes for an example resource."""
    example = yaml.safe_load((ROOT / "examples" / example_file).read_text())
    owner = m.Owner(name="llama3-8b", namespace="team-a", uid="uid-1")
    spec = s.parse_spec(example["spec"])
    deployments = [d for d in m.desired_children(owner, spec) if d["kind"] == "Deployment"]
    return [d["spec"]["template"] for d in deployments]


def test_worker_pod_monitor_selects_every_worker_pod_and_its_metrics_port(render):
    docs = render("-f", CHART / "ci" / "monitoring-values.yaml", "-f", CHART / "ci" / "namespaced-values.yaml")
    (pm,) = by_kind(docs, "PodMonitor")
    assert pm["apiVersion"] == "monitoring.coreos.com/v1"
    assert pm["metadata"]["labels"]["release"] == "prometheus"
    assert pm["spec"]["namespaceSelector"] == {"matchNames": ["team-a", "team-b"]}
    endpoints = pm["spec"]["podMetricsEndpoints"]
    assert {(e["path"], e["interval"]) for e in endpoints} == {("/metrics", "15s")}
    for tpl in worker_pod_templates() + worker_pod_templates("llama3-8b-gateway.yaml"):
        labels = tpl["metadata"]["labels"]
        assert pm["spec"]["selector"]["matchLabels"].items() <= labels.items()
        assert set(pm["spec"]["podTargetLabels"]) <= labels.keys()
        # each pod serves /metrics on exactly one of the endpoints' ports (else it would be scraped twice)
        ports = {p["name"] for c in tpl["spec"]["containers"] for p in c.get("ports", ())}
        assert len(ports & {e["port"] for e in endpoints}) == 1, (labels[naming.LABEL_COMPONENT], ports)
    (pm,) = by_kind(render("-f", CHART / "ci" / "monitoring-values.yaml"), "PodMonitor")
    assert pm["spec"]["namespaceSelector"] == {"any": True}


def test_worker_pod_monitor_labels_every_series_with_the_pods_role_and_resource(render):
    """vLLM's series carry no role: the PodMonitor takes it (and the resource) from the pod's labels, before any
    relabeling of the user's. (tests/integration/install/test_monitoring_prometheus.py runs them in Prometheus.)"""
    extra = {"targetLabel": "cluster", "replacement": "eu-1"}
    docs = render("-f", CHART / "ci" / "monitoring-values.yaml",
                  "--set-json", f"monitoring.workers.podMonitor.relabelings=[{json.dumps(extra)}]")
    (pm,) = by_kind(docs, "PodMonitor")
    meta = lambda label: "__meta_kubernetes_pod_label_" + sanitized(label)  # noqa: E731
    for endpoint in pm["spec"]["podMetricsEndpoints"]:
        assert endpoint["relabelings"] == [{"sourceLabels": [meta(naming.LABEL_COMPONENT)], "targetLabel": "role"},
                                           {"sourceLabels": [meta(naming.LABEL_INSTANCE)], "targetLabel": "resource"},
                                           extra]
    for tpl in worker_pod_templates() + worker_pod_templates("llama3-8b-gateway.yaml"):
        labels = tpl["metadata"]["labels"]
        assert labels[naming.LABEL_COMPONENT] in ("prefill", "decode", "router", "epp")
        assert naming.LABEL_INSTANCE in labels


def test_operator_metrics_endpoint_and_its_pod_monitor(render):
    docs = render("-f", CHART / "ci" / "operator-metrics-values.yaml")
    w, c = workload(docs), container(docs)
    port = next(p for p in c["ports"] if p["name"] == "metrics")
    assert parse_operator_args(c["args"]).metrics_port == port["containerPort"] == 9100
    monitors = {pm["metadata"]["name"]: pm for pm in by_kind(docs, "PodMonitor")}
    assert set(monitors) == {w["metadata"]["name"], w["metadata"]["name"] + "-workers"}
    pm = monitors[w["metadata"]["name"]]
    assert pm["metadata"]["labels"]["release"] == "prometheus"
    assert pm["spec"]["selector"]["matchLabels"].items() <= w["spec"]["template"]["metadata"]["labels"].items()
    assert pm["spec"]["namespaceSelector"] == {"matchNames": [w["metadata"]["namespace"]]}
    (endpoint,) = pm["spec"]["podMetricsEndpoints"]
    assert (endpoint["port"], endpoint["path"], endpoint["interval"]) == ("metrics", "/metrics", "30s")
    # the series' own namespace label (the resource's) must win over the operator pod's: the dashboard and alerts
    # select operator metrics by the resource's namespace
    assert endpoint["honorLabels"] is True


@pytest.mark.parametrize("values, message", [
    (["--set", "metrics.enabled=true", "--set", "metrics.port=8080"], "metrics.port 8080 is livenessPort"),
    (["--set", "monitoring.operator.podMonitor.enabled=true"], "'/metrics/enabled': value must be true"),
])
def test_operator_metrics_misconfigurations_name_the_fix(values, message, helm_home):
    proc = run_helm("template", "x", CHART, *values, home=helm_home, check=False)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr


# ---------------------------------------------------------------- documentation
def schema_paths(schema: dict, prefix: tuple[str, ...] = (), root: dict | None = None) -> list[tuple[str, ...]]:
    """Every option the schema declares, e.g. ("image", "tag"); free-form objects are one option."""
    root = root or schema
    out = []
    for key, sub in schema.get("properties", {}).items():
        if "$ref" in sub:  # "#/definitions/<name>"
            sub = root["definitions"][sub["$ref"].rsplit("/", 1)[-1]]
        out.append((*prefix, key))
        out.extend(schema_paths(sub, (*prefix, key), root))
    return out


def commented_keys(values_text: str) -> dict[tuple[str, ...], bool]:
    """key path in values.yaml -> whether a comment line directly precedes it (nested defaults included)."""
    out: dict[tuple[str, ...], bool] = {}
    stack: list[tuple[int, str]] = []
    previous = ""
    for line in values_text.splitlines():
        match = re.match(r"^(\s*)([A-Za-z][\w.-]*):", line)
        if match:
            indent = len(match.group(1))
            while stack and stack[-1][0] >= indent:
                stack.pop()
            stack.append((indent, match.group(2)))
            out[tuple(k for _, k in stack)] = previous.lstrip().startswith("#")
        previous = line if line.strip() else previous
    return out


def test_every_values_key_is_commented_and_in_the_schema():
    import json
    schema = json.loads((CHART / "values.schema.json").read_text())
    keys = commented_keys((CHART / "values.yaml").read_text())
    options = set(schema_paths(schema)) - {("global",)}
    top_level_values = {k for k in keys if len(k) == 1}
    assert top_level_values == {k for k in options if len(k) == 1}, "values.yaml and values.schema.json differ"
    missing = sorted(o for o in options if o not in keys)
    assert not missing, f"options in the schema but not in values.yaml: {missing}"
    undocumented = sorted(".".join(o) for o in options if not keys[o])
    assert not undocumented, f"values.yaml keys without a comment: {undocumented}"


def test_notes_show_how_to_apply_the_example_and_watch_its_status(helm_home):
    out = run_helm("install", "disagg", CHART, "--dry-run=client", "--namespace", "disagg-system",
                   "-f", CHART / "ci" / "namespaced-values.yaml", home=helm_home).stdout
    notes = out[out.index("NOTES:"):]
    assert "kubectl apply --namespace team-a -f examples/llama3-8b-gpu.yaml" in notes
    assert "kubectl get dinf --namespace team-a -w" in notes
    assert "--for=condition=Ready" in notes and "helm uninstall disagg --namespace disagg-system" in notes
    assert (ROOT / "examples" / "llama3-8b-gpu.yaml").exists()
