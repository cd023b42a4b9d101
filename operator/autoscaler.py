"""The autoscaler's I/O side: one pass reads a resource's worker pods and their metrics, asks the pure policy
(autoscale.decide), and records the decision in status.autoscaling (+ the ScalingActive, ScalingLimited and
TransferBound conditions). The reconcile pass applies status.autoscaling.<role>.desired to the Deployments, so
one writer owns replicas. Knows nothing about kopf; the API client and the clock are injected.

Scale-down loses no work: before a pool shrinks, its least-loaded ready pods get a low
controller.kubernetes.io/pod-deletion-cost, so the ReplicaSet removes those; the removed pod's SIGTERM drain
(worker) finishes its requests and keeps unread KV until pulled or the lease ends, inside the grace period
(spec.semantic_problems checks grace >= preStop + request drain + lease).

Where metrics come from (spec.autoscaling.metricsSource):
- scrape: GET http://<status.podIP>:<port>/metrics of each ready pod; port 8000 (the worker's) unless the pod
  carries the annotation disagg.dev/metrics-port (an exporter sidecar, or a test's fake worker on loopback).
- prometheus: instant queries; series are matched to the listed pods by the podLabel label.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge
from pydantic.alias_generators import to_camel

from disagg.operator import autoscale as a
from disagg.operator import manifests as m
from disagg.operator import metrics_source as ms
from disagg.operator import reconcile as r
from disagg.operator import spec as s
from disagg.operator.autoscale_inputs import ROLES, policy_from_spec
from disagg.operator.kube import ApiError, TransientApiError


log = logging.getLogger(__name__)

ANNOTATION_METRICS_PORT = f"{s.GROUP}/metrics-port"
ANNOTATION_DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
VICTIM_DELETION_COST = "-1000"  # below the default 0: the ReplicaSet removes these pods first


class Cluster(r.Cluster, Protocol):
    def list_objects(self, api_version: str, kind: str, namespace: str,
                     label_selector: str = "") -> list[dict[str, Any]]: ...


# ---------------------------------------------------------------- pods and samples
@dataclass(frozen=True)
class PodTarget:
    name: str
    role: str  # prefill | decode
    url: str  # http://<podIP>:<port>/metrics


def pod_ready(pod: dict[str, Any]) -> bool:
    st = pod.get("status") or {}
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in st.get("conditions") or [])
    return ready and st.get("phase") == "Running" and bool(st.get("podIP")) \
        and not pod["metadata"].get("deletionTimestamp")


def scrape_targets(pods: list[dict[str, Any]], role: str) -> list[PodTarget]:
    """Ready pods only: a starting or terminating pod's numbers say nothing about the pool's load."""
    out = []
    for pod in sorted((p for p in pods if pod_ready(p)), key=lambda p: p["metadata"]["name"]):
        port = int((pod["metadata"].get("annotations") or {}).get(ANNOTATION_METRICS_PORT, m.HTTP_PORT))
        out.append(PodTarget(pod["metadata"]["name"], role, f"http://{pod['status']['podIP']}:{port}/metrics"))
    return out


def scrape(targets: list[PodTarget], timeout: float, clock: Callable[[], float]) -> list[ms.PodSample]:
    return ms.scrape_pods([(t.url, t.name, t.role) for t in targets], timeout, clock)


def from_prometheus(targets: list[PodTarget], source: s.MetricsSource, clock: Callable[[], float]) -> list[
        ms.PodSample]:
    """One sample per target pod; a pod Prometheus has no series for is missing."""
    fetched = ms.PrometheusSource(source.prometheus_url or "", timeout=source.timeout_seconds,
                                  selector=source.selector or "", pod_label=source.pod_label).fetch()
    if isinstance(fetched, str):
        return [ms.PodSample(t.name, t.role, clock(), error=fetched) for t in targets]
    by_pod = {smp.pod: smp for smp in fetched}
    out = []
    for t in targets:
        smp = by_pod.get(t.name)
        out.append(ms.PodSample(t.name, t.role, smp.timestamp, smp.values, smp.histograms) if smp else
                   ms.PodSample(t.name, t.role, clock(), error=f"no series with {source.pod_label}={t.name!r}"))
    return out


def pods_to_remove(samples: list[ms.PodSample], count: int) -> list[str]:
    """The `count` least-loaded pods with fresh numbers (ties: by name)."""
    ranked = sorted((smp for smp in samples if not smp.missing), key=lambda smp: (ms.pod_load(smp), smp.pod))
    return [smp.pod for smp in ranked[:max(0, count)]]


def deletion_cost_patches(pods: list[dict[str, Any]], victims: list[str]) -> dict[str, dict[str, Any]]:
    """pod name -> metadata merge patch: the victims get the low cost, pods marked earlier lose the mark."""
    out = {}
    for pod in pods:
        name = pod["metadata"]["name"]
        has = (pod["metadata"].get("annotations") or {}).get(ANNOTATION_DELETION_COST)
        want = VICTIM_DELETION_COST if name in victims else None
        if has != want:
            out[name] = {"metadata": {"annotations": {ANNOTATION_DELETION_COST: want}}}
    return out


# ---------------------------------------------------------------- status
@dataclass(frozen=True)
class ScalingChange:
    role: str
    from_replicas: int
    to_replicas: int
    reason: str
    dry_run: bool

    @property
    def event_reason(self) -> str:
        verb = "ScaledUp" if self.to_replicas > self.from_replicas else "ScaledDown"
        return f"DryRun{verb}" if self.dry_run else verb

    @property
    def message(self) -> str:
        what = "would scale" if self.dry_run else "scaled"
        return f"{what} {self.role} from {self.from_replicas} to {self.to_replicas}: {self.reason}"


def status_metrics(metrics: dict[str, float | None]) -> dict[str, str]:
    """The policy's numbers as decimal strings (the API has no floats), camelCase, units in the names."""
    out = {}
    for name, value in metrics.items():
        if value is None or not math.isfinite(value):
            continue
        if name == "decode_kv_cache_usage":  # a fraction in the metric, a percent in the spec's target
            name, value = "decode_kv_cache_usage_percent", value * 100
        out[to_camel(name)] = f"{value:.4g}"
    return out


def scaling_status(decision: a.Decision, old: dict[str, Any], dry_run: bool,
                   now: datetime) -> tuple[dict[str, Any], list[ScalingChange]]:
    """status.autoscaling for this decision, and the pool changes it makes (or would make, in dry run)."""
    status: dict[str, Any] = {"dryRun": dry_run}
    changes = []
    for role, d in decision.roles.items():
        status[role] = {"current": d.current, "desired": d.desired, "reason": d.reason,
                        **({"limitedBy": d.limited_by} if d.limited_by else {})}
        if d.desired == d.current:
            continue
        # dry run: report a recommendation once, not every interval
        if dry_run and old.get("dryRun") and (old.get(role) or {}).get("desired") == d.desired:
            continue
        changes.append(ScalingChange(role, d.current, d.desired, d.reason, dry_run))
    if changes:
        c = changes[-1]
        status["lastDecision"] = {"time": now.strftime("%Y-%m-%dT%H:%M:%SZ"), "role": c.role,
                                  "from": c.from_replicas, "to": c.to_replicas, "reason": c.reason,
                                  **({"bottleneck": decision.bottleneck} if decision.bottleneck else {}),
                                  "dryRun": dry_run, "metrics": status_metrics(decision.metrics)}
    elif old.get("lastDecision"):
        status["lastDecision"] = old["lastDecision"]
    return status, changes


def scaling_conditions(decision: a.Decision, old: list[dict[str, Any]], generation: int,
                       now: datetime) -> list[dict[str, Any]]:
    """All conditions: the reconcile pass's as they are, the autoscaler's replaced."""
    ours = [{"type": c.type, "status": c.status, "reason": c.reason, "message": c.message,
             "observedGeneration": generation} for c in decision.conditions]
    ours = r.with_transition_times(ours, old, now)
    return [c for c in old if c.get("type") not in s.AUTOSCALING_CONDITIONS] + ours


# ---------------------------------------------------------------- the pass
def _mark_victims(cluster: Cluster, namespace: str, pods: list[dict[str, Any]], victims: list[str],
                  result: AutoscaleResult) -> None:
    """Best effort: without the mark (RBAC lacks pods/patch, the pod is gone) the ReplicaSet picks by its own
    rules and the worker's drain still finishes the removed pod's work. Transient errors fail the pass (the next
    interval tries again) so a scale-down is not made without its mark for a passing reason."""
    for name, patch in deletion_cost_patches(pods, victims).items():
        try:
            cluster.patch("v1", "Pod", namespace, name, patch)
            result.cost_patched.append(name)
        except TransientApiError:
            raise
        except ApiError as e:
            log.warning("pod-deletion-cost on %s/%s not set: %s", namespace, name, e)
            result.cost_failed.append(f"{name}: {e}")


@dataclass
class AutoscaleResult:
    decision: a.Decision
    history: a.ScalingHistory  # pass to the next call
    interval_seconds: int
    dry_run: bool
    changes: list[ScalingChange] = field(default_factory=list)
    status_written: bool = False
    cost_patched: list[str] = field(default_factory=list)  # pods whose deletion cost was set or cleared
    cost_failed: list[str] = field(default_factory=list)  # "pod: error" where that write was refused


def autoscale(body: dict[str, Any], cluster: Cluster, history: a.ScalingHistory, now: datetime,
              clock: Callable[[], float]) -> AutoscaleResult | None:
    """One decision for one resource. None: gone, invalid, autoscaling off, or no Deployments yet.
    `clock`: seconds (the samples' timestamps); `now`: the same instant for status."""
    meta = body["metadata"]
    body = cluster.get(s.API_VERSION, s.KIND, meta["namespace"], meta["name"])  # type: ignore[assignment]
    if body is None:
        return None
    spec, problems = r.check(body)
    if spec is None or problems or not spec.autoscaling.enabled:
        return None
    meta = body["metadata"]
    owner = m.Owner(name=meta["name"], namespace=meta["namespace"], uid=meta["uid"])
    deployments = {role: cluster.get("apps/v1", "Deployment", owner.namespace, m.child_name(owner, role))
                   for role in ROLES}
    if any(d is None for d in deployments.values()):
        return None
    # what the reconcile pass applies (the Deployments' replicas, unless someone edited them by hand: that edit is
    # reverted, not taken as the pool's size)
    current = {role: n for role, (n, _) in r.worker_replicas(spec, body.get("status") or {}).items()}
    pods = {role: cluster.list_objects("v1", "Pod", owner.namespace, m.label_selector(owner, role))
            for role in ROLES}
    targets = [t for role in ROLES for t in scrape_targets(pods[role], role)]
    source = spec.autoscaling.metrics_source
    samples = (from_prometheus(targets, source, clock) if source.type == "prometheus"
               else scrape(targets, source.timeout_seconds, clock))
    by_role = {role: [smp for smp in samples if smp.role == role] for role in ROLES}
    decision = a.decide(by_role, current, policy_from_spec(spec.autoscaling), history, clock())
    dry_run = spec.autoscaling.dry_run
    old = body.get("status") or {}
    scaled, changes = scaling_status(decision, old.get("autoscaling") or {}, dry_run, now)
    result = AutoscaleResult(decision, decision.history, spec.autoscaling.interval_seconds, dry_run, changes)
    if not dry_run:
        for role, d in decision.roles.items():
            if d.desired < d.current:
                _mark_victims(cluster, owner.namespace, pods[role], pods_to_remove(by_role[role],
                                                                                    d.current - d.desired), result)
    conditions = scaling_conditions(decision, old.get("conditions") or [], int(meta.get("generation", 0)), now)
    if scaled != old.get("autoscaling") or conditions != old.get("conditions"):
        cluster.patch(s.API_VERSION, s.KIND, owner.namespace, owner.name,
                      {"status": {"autoscaling": r.merge_patch(old.get("autoscaling") or {}, scaled),
                                  "conditions": conditions}}, subresource="status")
        result.status_written = True
    return result


# ---------------------------------------------------------------- operator metrics
class OperatorMetrics:
    """The operator's own Prometheus metrics, on a registry of its own (served by `disagg operator
    --metrics-port`)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        labels = ("namespace", "name", "role")
        self.desired_replicas = Gauge("disagg_operator_desired_replicas", "Replicas the autoscaler wants per pool.",
                                      labels, registry=self.registry)
        self.decisions = Counter("disagg_operator_scaling_decisions", "Autoscaling decisions per pool, by reason.",
                                 (*labels, "reason"), registry=self.registry)

    def observe(self, namespace: str, name: str, decision: a.Decision) -> None:
        for role, d in decision.roles.items():
            self.desired_replicas.labels(namespace, name, role).set(d.desired)
            self.decisions.labels(namespace, name, role, d.reason).inc()
