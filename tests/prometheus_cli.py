"""Prometheus for the monitoring tests: the chart's dashboard and alert rules as rendered, the metric names the
worker, router and operator really export, and a real Prometheus server on loopback (Debian's `prometheus`
package, installed by .ci/run; the tests skip when the binary is missing)."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

from helm_cli import template

CHART = Path(__file__).resolve().parents[1] / "charts" / "disagg-operator"
DASHBOARD = CHART / "dashboards" / "disagg.json"
MISSING = "the prometheus binary is not installed (Debian: apt-get install prometheus; .ci/run does)"

# metric names in PromQL: ours carry a `vllm:`/`disagg:` or `disagg_operator_` prefix; `up` is Prometheus' own
METRIC_NAME = re.compile(r"\b(?:(?:vllm|disagg):[A-Za-z0-9_:]+|disagg_operator_[a-z_]+|up(?=\{))")
SELECTOR = re.compile(r"\b((?:vllm|disagg):[A-Za-z0-9_:]+|disagg_operator_[a-z_]+|up)(\{[^}]*\})?")


def binary(name: str) -> str | None:
    return shutil.which(name)


def exported_metric_names() -> set[str]:
    """Every series name the three exporters can emit (counters with _total, histograms' three series), plus up."""
    from disagg.operator.autoscaling.cluster import OperatorMetrics
    from disagg.worker.router.handoffs import HandoffLedger
    from disagg.worker.router.metrics import RouterMetrics
    from disagg.worker.server.metrics import WorkerMetrics

    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "gauge": ("",)}
    names = {"up"}
    router = RouterMetrics("m")  # with its per-endpoint hand-off gauges, as a router with endpoints has them
    router.watch_handoffs(HandoffLedger(), lambda: [("prefill", "http://p", "p-0"), ("decode", "http://d", "d-0")])
    for registry in (WorkerMetrics("m", "decode").registry, router.registry, OperatorMetrics().registry):
        for family in registry.collect():
            names |= {family.name + s for s in suffixes[family.type]}
    return names


def dashboard_queries(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title, PromQL) of every panel target."""
    return [(p["title"], t["expr"]) for p in dashboard["panels"] for t in p.get("targets", ())]


def substitute(expr: str, variables: dict[str, str]) -> str:
    """Grafana's template variables replaced as Grafana would (regex values for the multi-value ones)."""
    for name in sorted(variables, key=len, reverse=True):  # $__rate_interval before $role etc.
        expr = expr.replace("$" + name, variables[name])
    return expr


def render_monitoring(helm_home: Path, *args: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the dashboard ConfigMap, the PrometheusRule) of the chart with both enabled."""
    docs = template(CHART, helm_home, "--set", "monitoring.dashboards.enabled=true",
                    "--set", "monitoring.prometheusRule.enabled=true", *args)
    (cm,) = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("-dashboard")]
    (rule,) = [d for d in docs if d["kind"] == "PrometheusRule"]
    return cm, rule


def render_worker_pod_monitor(helm_home: Path, *args: str) -> dict[str, Any]:
    """The chart's PodMonitor of the worker pods (monitoring.workers.podMonitor.enabled)."""
    docs = template(CHART, helm_home, "--set", "monitoring.workers.podMonitor.enabled=true", *args)
    (pm,) = [d for d in docs if d["kind"] == "PodMonitor" and d["metadata"]["name"].endswith("-workers")]
    return pm


@dataclass(frozen=True)
class DiscoveredPod:
    """A pod as Kubernetes pod discovery would find it: one container port serving /metrics."""

    address: str  # host:port
    namespace: str
    pod: str
    labels: dict[str, str]  # the pod's labels (as the operator sets them)
    container: str = "worker"
    port_name: str = "http"


def sanitized(label: str) -> str:
    """A Kubernetes label key as Prometheus' pod discovery names it (__meta_kubernetes_pod_label_<this>)."""
    return re.sub(r"[^a-zA-Z0-9_]", "_", label)


RELABEL_KEYS = {"sourceLabels": "source_labels", "separator": "separator", "targetLabel": "target_label",
                "regex": "regex", "modulus": "modulus", "replacement": "replacement", "action": "action"}


def relabel_config(rule: dict[str, Any]) -> dict[str, Any]:
    """A prometheus-operator RelabelConfig as Prometheus' relabel_config (it lowercases the action)."""
    unknown = set(rule) - RELABEL_KEYS.keys()
    assert not unknown, f"relabeling keys this converter does not know: {sorted(unknown)}"
    out = {RELABEL_KEYS[k]: v for k, v in rule.items()}
    if "action" in out:
        out["action"] = out["action"].lower()
    return out


def pod_monitor_scrape_configs(pm: dict[str, Any], targets: list[DiscoveredPod]) -> list[dict[str, Any]]:
    """The scrape configs the Prometheus Operator generates for the PodMonitor, one per endpoint."""
    return [pod_monitor_scrape_config(pm, i, targets) for i in range(len(pm["spec"]["podMetricsEndpoints"]))]


def pod_monitor_scrape_config(pm: dict[str, Any], index: int, targets: list[DiscoveredPod]) -> dict[str, Any]:
    """The scrape config the Prometheus Operator generates for the PodMonitor's endpoint `index` (its
    generatePodMonitorConfig: keep the pods its selector and port match; namespace, container and pod labels;
    podTargetLabels; job, then jobLabel; endpoint; then the endpoint's own relabelings), with static targets in
    place of Kubernetes discovery: each carries the __meta_kubernetes_* labels pod discovery gives a pod, so the
    relabeling really runs, and a pod the PodMonitor would not select is dropped."""
    spec = pm["spec"]
    endpoint = spec["podMetricsEndpoints"][index]
    rules: list[dict[str, Any]] = [
        {"source_labels": [f"__meta_kubernetes_pod_label_{sanitized(k)}",
                           f"__meta_kubernetes_pod_labelpresent_{sanitized(k)}"], "action": "keep",
         "regex": f"({v});true"} for k, v in sorted(spec["selector"]["matchLabels"].items())]
    rules += [{"source_labels": ["__meta_kubernetes_pod_container_port_name"], "action": "keep",
               "regex": endpoint["port"]},
              {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
              {"source_labels": ["__meta_kubernetes_pod_container_name"], "target_label": "container"},
              {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"}]
    rules += [{"source_labels": [f"__meta_kubernetes_pod_label_{sanitized(k)}"], "regex": "(.+)",
               "replacement": "${1}", "target_label": sanitized(k)} for k in spec.get("podTargetLabels", ())]
    rules.append({"target_label": "job", "replacement": f"{pm['metadata']['namespace']}/{pm['metadata']['name']}"})
    if spec.get("jobLabel"):
        rules.append({"source_labels": [f"__meta_kubernetes_pod_label_{sanitized(spec['jobLabel'])}"],
                      "regex": "(.+)", "replacement": "${1}", "target_label": "job"})
    rules.append({"target_label": "endpoint", "replacement": endpoint["port"]})
    rules += [relabel_config(r) for r in endpoint.get("relabelings", ())]

    def discovered(t: DiscoveredPod) -> dict[str, str]:
        meta = {"__meta_kubernetes_namespace": t.namespace, "__meta_kubernetes_pod_name": t.pod,
                "__meta_kubernetes_pod_container_name": t.container,
                "__meta_kubernetes_pod_container_port_name": t.port_name}
        for k, v in t.labels.items():
            meta[f"__meta_kubernetes_pod_label_{sanitized(k)}"] = v
            meta[f"__meta_kubernetes_pod_labelpresent_{sanitized(k)}"] = "true"
        return meta

    return {"job_name": f"podMonitor/{pm['metadata']['namespace']}/{pm['metadata']['name']}/{index}",
            "honor_labels": bool(endpoint.get("honorLabels", False)), "metrics_path": endpoint.get("path", "/metrics"),
            "static_configs": [{"targets": [t.address], "labels": discovered(t)} for t in targets],
            "relabel_configs": rules,
            "metric_relabel_configs": [relabel_config(r) for r in endpoint.get("metricRelabelings", ())]}


def write_rules_file(rule: dict[str, Any], path: Path) -> Path:
    """The PrometheusRule's spec is a Prometheus rules file as is."""
    path.write_text(yaml.safe_dump(rule["spec"], sort_keys=False))
    return path


def alerts(rule: dict[str, Any]) -> dict[str, str]:
    return {r["alert"]: r["expr"] for g in rule["spec"]["groups"] for r in g["rules"] if "alert" in r}


def load_dashboard(cm: dict[str, Any]) -> dict[str, Any]:
    (payload,) = cm["data"].values()
    return json.loads(payload)


class PrometheusServer:
    """`prometheus` on 127.0.0.1:port with its TSDB in a temp dir; stop() terminates it (and is idempotent)."""

    def __init__(self, config: dict[str, Any], workdir: Path, port: int):
        self.url = f"http://127.0.0.1:{port}"
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config, sort_keys=False))
        self.log = open(workdir / "prometheus.log", "wb")
        self.proc = subprocess.Popen(
            [binary("prometheus"), f"--config.file={workdir / 'prometheus.yml'}",
             f"--storage.tsdb.path={workdir / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}",
             "--storage.tsdb.retention.time=1h"], stdout=self.log, stderr=subprocess.STDOUT)

    def ready(self) -> bool:
        assert self.proc.poll() is None, f"prometheus exited: {Path(self.log.name).read_text()[-2000:]}"
        try:
            return httpx.get(f"{self.url}/-/ready", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def query(self, promql: str) -> dict[str, Any]:
        """The /api/v1/query answer (status, data or errorType/error), whatever the HTTP status."""
        return httpx.get(f"{self.url}/api/v1/query", params={"query": promql}, timeout=10).json()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.log.close()
