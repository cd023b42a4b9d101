"""The autoscaling pass on Kubernetes against an in-memory cluster, with scraping replaced by fixed samples."""
from __future__ import annotations

import copy
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from test_reconcile import FakeCluster, example, run_pass

from disagg.operator import reconcile as r
from disagg.operator.autoscaling import cluster as sc
from disagg.operator.autoscaling import samples as ms
from disagg.operator.autoscaling import sources
from disagg.operator.autoscaling.report import status_metrics
from disagg.operator.autoscaling.scaling_pass import PassState
from disagg.operator.kube import ApiError, TransientApiError
from disagg.operator import naming

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
NAME, NS = "llama3-8b", "ns"


class PodCluster(FakeCluster):
    def list_objects(self, api_version: str, kind: str, namespace: str, label_selector: str = "") -> list[dict]:
        want = dict(term.split("=", 1) for term in label_selector.split(",") if term)
        return [copy.deepcopy(o) for (k, ns, _), o in self.objects.items() if k == kind and ns == namespace
                and all(o["metadata"].get("labels", {}).get(key) == v for key, v in want.items())]

    def add_pod(self, role: str, index: int, ready: bool = True, port: int | None = None) -> str:
        name = f"{NAME}-{role}-{index}"
        labels = {"app.kubernetes.io/name": "disagg", "app.kubernetes.io/instance": NAME,
                  "app.kubernetes.io/component": role}
        meta: dict[str, Any] = {"name": name, "namespace": NS, "labels": labels}
        if port is not None:
            meta["annotations"] = {naming.ANNOTATION_METRICS_PORT: str(port)}
        self.objects[("Pod", NS, name)] = {
            "apiVersion": "v1", "kind": "Pod", "metadata": meta,
            "status": {"phase": "Running", "podIP": f"10.0.0.{index}",
                       "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}
        return name


def autoscaling_example(**autoscaling: Any) -> dict[str, Any]:
    doc = example()
    doc["spec"]["prefill"]["replicas"], doc["spec"]["decode"]["replicas"] = 1, 2
    doc["spec"]["autoscaling"] = {"enabled": True, "intervalSeconds": 1,
                                  "prefill": {"minReplicas": 1, "maxReplicas": 3},
                                  "decode": {"minReplicas": 1, "maxReplicas": 3},
                                  "stabilization": {"scaleDownSeconds": 0}, **autoscaling}
    return doc


def sample(pod: str, role: str, **values: float) -> ms.PodSample:
    names = {"waiting": ms.NUM_REQUESTS_WAITING, "running": ms.NUM_REQUESTS_RUNNING, "kv": ms.KV_CACHE_USAGE,
             "sends": ms.PENDING_SENDS}
    return ms.PodSample(pod, role, T0.timestamp(), {names[k]: v for k, v in values.items()})


@pytest.fixture
def cluster(monkeypatch: pytest.MonkeyPatch) -> PodCluster:
    c = PodCluster()
    c.samples = {}  # type: ignore[attr-defined]
    monkeypatch.setattr(sc, "scrape", lambda targets, timeout, clock: [
        c.samples.get(t.name) or ms.PodSample(t.name, t.role, clock(), error="refused")  # type: ignore[attr-defined]
        for t in targets])
    return c


def setup(cluster: PodCluster, doc: dict[str, Any], decode_kv: list[float]) -> None:
    cluster.add_resource(doc)
    run_pass(cluster)  # creates the Deployments
    p = cluster.add_pod("prefill", 0)
    cluster.samples[p] = sample(p, "prefill", waiting=1)  # type: ignore[attr-defined]
    for i, kv in enumerate(decode_kv):
        d = cluster.add_pod("decode", i + 1)
        cluster.samples[d] = sample(d, "decode", kv=kv, running=10 * (i + 1))  # type: ignore[attr-defined]


def decide(cluster: PodCluster, now: datetime = T0, state: PassState | None = None) -> sc.AutoscaleResult:
    result = sc.autoscale(cluster.resource(), cluster, state or PassState(), now, lambda: now.timestamp())
    assert result is not None
    return result


def dep_replicas(cluster: PodCluster, role: str) -> int:
    return cluster.get("apps/v1", "Deployment", NS, f"{NAME}-{role}")["spec"]["replicas"]  # type: ignore[index]


def test_decode_bound_scales_the_deployment_and_reports_in_status(cluster):
    setup(cluster, autoscaling_example(), [0.95, 0.95])
    cluster.writes.clear()
    result = decide(cluster)
    assert [(c.role, c.from_replicas, c.to_replicas, c.reason, c.event_reason) for c in result.changes] == \
        [("decode", 2, 3, "DecodeBound", "ScaledUp")]
    # as an HPA: the Deployment's replicas, then the report; no other write
    assert [(w[0], w[1]) for w in cluster.writes] == [("patch", f"Deployment/{NAME}-decode"),
                                                      ("patch/status", f"DisaggregatedInference/{NAME}")]
    assert dep_replicas(cluster, "decode") == 3 and result.scaled == [f"{NAME}-decode"]
    st = cluster.resource()["status"]
    decode = st["autoscaling"]["decode"]
    assert {k: decode[k] for k in ("current", "desired", "reason")} == {"current": 2, "desired": 3,
                                                                          "reason": "DecodeBound"}
    # these pods export KV usage only: status says what the decision read and what it had to do without
    assert decode["signalsUsed"] == ["kvCacheUsage"] and "pendingLoads" in decode["signalsUnavailable"]
    last = st["autoscaling"]["lastDecision"]
    assert (last["role"], last["from"], last["to"], last["bottleneck"], last["time"]) == \
        ("decode", 2, 3, "DecodeBound", "2026-01-01T00:00:00Z")
    assert last["metrics"]["decodeKvCacheUsagePercent"] == "95"
    assert {c["type"]: c["status"] for c in st["conditions"]} == \
        {"Ready": "False", "Progressing": "True", "Degraded": "False",  # the reconcile pass's, kept
         "ScalingActive": "True", "ScalingLimited": "False", "TransferBound": "False"}
    cluster.writes.clear()
    run_pass(cluster)  # the reconcile pass leaves the autoscaler's replicas alone
    assert dep_replicas(cluster, "decode") == 3
    assert [w[1] for w in cluster.writes if w[0] != "patch/status"] == []
    assert [c["type"] for c in cluster.resource()["status"]["conditions"]][-3:] == \
        ["ScalingActive", "ScalingLimited", "TransferBound"]
    cluster.writes.clear()
    later = T0 + timedelta(seconds=1)
    again = sc.autoscale(cluster.resource(), cluster, result.state, later, lambda: later.timestamp())
    assert again is not None and again.changes == [] and again.scaled == []  # 4 wanted, maxReplicas 3
    decode = cluster.resource()["status"]["autoscaling"]["decode"]
    assert {k: decode.get(k) for k in ("current", "desired", "reason", "limitedBy")} == \
        {"current": 3, "desired": 3, "reason": "DecodeBound", "limitedBy": "TooManyReplicas"}
    assert cluster.resource()["status"]["autoscaling"]["lastDecision"] == last  # kept


def test_scale_down_marks_the_least_loaded_pod_and_clears_old_marks(cluster):
    setup(cluster, autoscaling_example(), [0.1, 0.1])
    busy = f"{NAME}-decode-2"
    cluster.objects[("Pod", NS, busy)]["metadata"]["annotations"] = {naming.ANNOTATION_DELETION_COST: "-1000"}
    result = decide(cluster)
    assert [(c.role, c.to_replicas, c.reason) for c in result.changes] == [("decode", 1, "Underutilized")]
    assert result.cost_patched == [f"{NAME}-decode-1", busy]  # decode-1 runs 10 requests, decode-2 runs 20
    cost = lambda pod: (cluster.objects[("Pod", NS, pod)]["metadata"].get("annotations") or {}).get(  # noqa: E731
        naming.ANNOTATION_DELETION_COST)
    assert (cost(f"{NAME}-decode-1"), cost(busy)) == ("-1000", None)
    assert dep_replicas(cluster, "decode") == 1
    run_pass(cluster)
    assert dep_replicas(cluster, "decode") == 1


def test_forbidden_deletion_cost_does_not_stop_the_scale_down(cluster, monkeypatch):
    setup(cluster, autoscaling_example(), [0.1, 0.1])
    patch = cluster.patch

    def refuse_pods(api_version, kind, *args, **kwargs):
        if kind == "Pod":
            raise ApiError(403, "PATCH", "/api/v1/.../pods/x", "forbidden")
        return patch(api_version, kind, *args, **kwargs)
    monkeypatch.setattr(cluster, "patch", refuse_pods)
    result = decide(cluster)
    assert [c.to_replicas for c in result.changes] == [1] and result.status_written
    assert result.cost_patched == [] and "forbidden" in result.cost_failed[0]
    monkeypatch.setattr(cluster, "patch", lambda *a, **k: (_ for _ in ()).throw(  # a busy API server
        TransientApiError(503, "PATCH", "/x", "busy")))
    with pytest.raises(TransientApiError):
        decide(cluster)


def test_dry_run_reports_once_and_writes_no_deployment_or_pod(cluster):
    setup(cluster, autoscaling_example(dryRun=True), [0.1, 0.1])
    cluster.writes.clear()
    first = decide(cluster)
    assert [(c.event_reason, c.message) for c in first.changes] == \
        [("DryRunScaledDown", "would scale decode from 2 to 1: Underutilized")]
    assert (first.cost_patched, [w[0] for w in cluster.writes]) == ([], ["patch/status"])
    assert cluster.resource()["status"]["autoscaling"]["dryRun"] is True
    run_pass(cluster)
    assert dep_replicas(cluster, "decode") == 2
    second = decide(cluster, T0 + timedelta(seconds=1), first.state)
    assert second.changes == [] and not second.status_written  # same recommendation: no new report
    assert dep_replicas(cluster, "decode") == 2 and second.scaled == []


def test_a_hand_edit_is_not_taken_as_the_pools_size_but_undone(cluster):
    setup(cluster, autoscaling_example(), [0.8, 0.8])
    cluster.objects[("Deployment", NS, f"{NAME}-decode")]["spec"]["replicas"] = 3  # kubectl scale
    run_pass(cluster)  # the reconcile pass does not undo it: the autoscaler owns the replicas
    assert dep_replicas(cluster, "decode") == 3
    result = decide(cluster)
    assert (result.changes, result.decision.roles["decode"].current) == ([], 2)
    assert result.replicas_reverted == [r.ReplicasReverted(f"{NAME}-decode", 3, 2, sc.REVERTED_SOURCE)]
    assert dep_replicas(cluster, "decode") == 2
    again = decide(cluster, T0 + timedelta(seconds=1), result.state)
    assert (again.scaled, again.replicas_reverted) == ([], [])


def test_a_scale_keeps_the_last_applied_record_so_reconcile_writes_nothing(cluster):
    setup(cluster, autoscaling_example(), [0.95, 0.95])
    decide(cluster)
    dep = cluster.get("apps/v1", "Deployment", NS, f"{NAME}-decode")
    assert r.applied_replicas(dep) == 3  # type: ignore[arg-type]
    cluster.writes.clear()
    assert run_pass(cluster).children_written == []


def test_unreachable_or_unready_pods(cluster):
    setup(cluster, autoscaling_example(), [0.95])
    cluster.add_pod("decode", 7, ready=False)  # not scraped at all
    result = decide(cluster)
    assert result.decision.roles["decode"].desired == 3
    del cluster.samples[f"{NAME}-decode-1"]  # type: ignore[attr-defined]
    held = decide(cluster)
    assert held.changes == [] and held.decision.reason == "MetricsMissing"
    active = next(c for c in cluster.resource()["status"]["conditions"] if c["type"] == "ScalingActive")
    assert (active["status"], active["reason"]) == ("False", "MetricsMissing")
    assert "decode-1" in active["message"]


def test_a_lowered_max_is_applied_by_the_autoscaler_even_without_metrics(cluster):
    setup(cluster, autoscaling_example(), [0.8, 0.8])
    body = cluster.objects[("DisaggregatedInference", NS, NAME)]
    body["spec"]["autoscaling"]["decode"]["maxReplicas"] = 1
    run_pass(cluster)
    assert dep_replicas(cluster, "decode") == 2, "reconcile leaves an autoscaled Deployment's replicas alone"
    cluster.samples.clear()  # type: ignore[attr-defined]
    held = decide(cluster)
    assert (held.decision.reason, held.decision.roles["decode"].limited_by) == ("MetricsMissing", "TooManyReplicas")
    assert dep_replicas(cluster, "decode") == 1


def test_autoscaling_off_or_invalid_does_nothing(cluster):
    doc = autoscaling_example()
    doc["spec"]["autoscaling"]["enabled"] = False
    cluster.add_resource(doc)
    assert sc.autoscale(cluster.resource(), cluster, PassState(), T0, lambda: 0.0) is None
    assert sc.autoscale({"metadata": {"name": "gone", "namespace": NS}}, cluster, PassState(), T0,
                        lambda: 0.0) is None


def test_scrape_targets_use_pod_ip_and_port_annotation():
    c = PodCluster()
    c.add_pod("decode", 1)
    c.add_pod("decode", 2, port=31234)
    c.add_pod("decode", 3, ready=False)
    targets = sc.scrape_targets(c.list_objects("v1", "Pod", NS), "decode")
    assert [t.url for t in targets] == ["http://10.0.0.1:8000/metrics", "http://10.0.0.2:31234/metrics"]


def test_status_metrics_are_camel_case_decimal_strings():
    assert status_metrics({"decode_kv_cache_usage": 0.8312, "prefill_ttft_seconds": 0.25, "x_y": None,
                              "failed_transfers": float("inf")}) == \
        {"decodeKvCacheUsagePercent": "83.12", "prefillTtftSeconds": "0.25"}


def test_operator_metrics():
    from prometheus_client import generate_latest
    result_decision = type("D", (), {"roles": {"decode": type("R", (), {"desired": 3, "reason": "DecodeBound"})}})
    om = sc.OperatorMetrics()
    om.observe(NS, NAME, result_decision)  # type: ignore[arg-type]
    om.observe(NS, NAME, result_decision)  # type: ignore[arg-type]
    text = generate_latest(om.registry).decode()
    assert f'disagg_operator_desired_replicas{{name="{NAME}",namespace="{NS}",role="decode"}} 3.0' in text
    assert (f'disagg_operator_scaling_decisions_total{{name="{NAME}",namespace="{NS}",reason="DecodeBound",'
            'role="decode"} 2.0') in text


def test_prometheus_samples_are_matched_to_the_listed_pods(monkeypatch):
    from disagg.operator import spec as s
    targets = [sc.PodTarget("p-1", "prefill", ""), sc.PodTarget("d-1", "decode", "")]
    source = s.MetricsSource(type="prometheus", prometheus_url="http://prom:9090", pod_label="kubernetes_pod_name")
    fetched = [ms.PodSample("d-1", "", 5.0, {ms.KV_CACHE_USAGE: 0.5}), ms.PodSample("other-ns-pod", "decode", 5.0)]
    monkeypatch.setattr(sources.PrometheusSource, "fetch", lambda self, roles=(): fetched)
    p, d = sc.from_prometheus(targets, source, lambda: 9.0)
    assert (p.pod, p.missing, p.timestamp) == ("p-1", True, 9.0) and "kubernetes_pod_name='p-1'" in p.error
    assert (d.role, d.values, d.missing) == ("decode", {ms.KV_CACHE_USAGE: 0.5}, False)
    monkeypatch.setattr(sources.PrometheusSource, "fetch", lambda self, roles=(): "ConnectError: refused")
    assert [smp.error for smp in sc.from_prometheus(targets, source, lambda: 9.0)] == ["ConnectError: refused"] * 2


def test_a_router_pods_per_endpoint_view_read_through_prometheus_reaches_the_worker_pods(monkeypatch):
    """metricsSource prometheus: the router pod's sample keeps what it measured per endpoint, so the pass gives a
    vLLM prefill pod its pending sends (the signal it does not export itself)."""
    from disagg.operator import spec as s
    from disagg.operator.autoscaling.samples import ROUTER_PENDING_SENDS, attribute_handoff_signals
    targets = [sc.PodTarget("p-1", "prefill", ""), sc.PodTarget("r-1", "router", "")]
    source = s.MetricsSource(type="prometheus", prometheus_url="http://prom:9090")
    fetched = [ms.PodSample("p-1", "prefill", 5.0, {ms.NUM_REQUESTS_WAITING: 1.0}),
               ms.PodSample("r-1", "router", 5.0, endpoint_signals={"p-1": {ROUTER_PENDING_SENDS: 3.0}})]
    monkeypatch.setattr(sources.PrometheusSource, "fetch", lambda self, roles=(): fetched)
    p, _ = attribute_handoff_signals(sc.from_prometheus(targets, source, lambda: 9.0))
    assert p.values == {ms.NUM_REQUESTS_WAITING: 1.0, ROUTER_PENDING_SENDS: 3.0}
