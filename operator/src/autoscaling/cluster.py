"""The autoscaling pass on Kubernetes: read a resource's worker pods and their metrics, run the shared pass
(scaling_pass.run_pass), then apply it - as an HPA writes a Deployment's scale, the autoscaler owns the worker
Deployments' spec.replicas while autoscaling is on (reconcile sets them only at creation). Status
(status.autoscaling + the ScalingActive, ScalingLimited and TransferBound conditions) is a report of the decision,
never read back to decide. Knows nothing about kopf; the API client and the clock are injected.

The pool's size the decision starts from is the replicas the operator last applied to the Deployment (its
last-applied annotation, which every scale rewrites): a hand `kubectl scale` is not taken as the pool's size but
undone at the next decision, and reported.

Scale-down loses no work: before a pool shrinks, the pods chosen to go get a low
controller.kubernetes.io/pod-deletion-cost, so the ReplicaSet removes those; the removed pod's SIGTERM drain
(worker) finishes its requests and keeps unread KV until pulled or the lease ends, inside the grace period
(checks.semantic_problems checks grace >= preStop + request drain + lease).

Where metrics come from (spec.autoscaling.metricsSource):
- scrape: GET http://<status.podIP>:<port>/metrics of each ready pod; port 8000 (the worker's) unless the pod
  carries the annotation disagg.dev/metrics-port (an exporter sidecar, or a test's fake worker on loopback).
- prometheus: instant queries; series are matched to the listed pods by the podLabel label.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge

from disagg.operator import manifests as m
from disagg.operator import reconcile as r
from disagg.operator import spec as s
from disagg.operator.autoscaling import sources
from disagg.operator.autoscaling.inputs import ROLES, policy_from_spec
from disagg.operator.autoscaling.policy import Decision
from disagg.operator.autoscaling.report import ScalingChange, iso, status_metrics
from disagg.operator.autoscaling.samples import PodSample
from disagg.operator.autoscaling.scaling_pass import PassOutcome, PassState, run_pass
from disagg.operator.autoscaling.zero import ZeroState, ZeroStep
from disagg.operator.kube import ApiError, TransientApiError
from disagg.operator.naming import (
    ANNOTATION_DELETION_COST, ANNOTATION_METRICS_PORT, HTTP_PORT, child_name, label_selector,
)

log = logging.getLogger(__name__)

VICTIM_DELETION_COST = "-1000"  # below the default 0: the ReplicaSet removes these pods first
REVERTED_SOURCE = "the autoscaler's decision"  # where a reverted hand edit's replicas come from
ZERO_POLL_S = 1  # with the pools at zero, seconds between passes (each reads only the router pods)


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
        port = int((pod["metadata"].get("annotations") or {}).get(ANNOTATION_METRICS_PORT, HTTP_PORT))
        out.append(PodTarget(pod["metadata"]["name"], role, f"http://{pod['status']['podIP']}:{port}/metrics"))
    return out


def removable_pods(pods: list[dict[str, Any]]) -> list[str]:
    """Pods not already terminating, newest first (ties of the removal choice go to the newest)."""
    alive = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
    alive.sort(key=lambda p: (p["metadata"].get("creationTimestamp") or "", p["metadata"]["name"]), reverse=True)
    return [p["metadata"]["name"] for p in alive]


def scrape(targets: list[PodTarget], timeout: float, clock: Callable[[], float]) -> list[PodSample]:
    return sources.scrape_pods([(t.url, t.name, t.role) for t in targets], timeout, clock)


def from_prometheus(targets: list[PodTarget], source: s.MetricsSource, clock: Callable[[], float]) -> list[
        PodSample]:
    """One sample per target pod; a pod Prometheus has no series for is missing. Series are selected by their
    `role` label, which the chart's worker PodMonitor sets from the pod's component label for either engine (vLLM
    exports none); a router pod's sample keeps what it measured per endpoint (attribute_handoff_signals)."""
    fetched = sources.PrometheusSource(source.prometheus_url or "", timeout=source.timeout_seconds,
                                       selector=source.selector or "",
                                       pod_label=source.pod_label).fetch(roles=("prefill", "decode", "router"))
    if isinstance(fetched, str):
        return [PodSample(t.name, t.role, clock(), error=fetched) for t in targets]
    by_pod = {smp.pod: smp for smp in fetched}
    out = []
    for t in targets:
        smp = by_pod.get(t.name)
        out.append(PodSample(t.name, t.role, smp.timestamp, smp.values, smp.histograms,
                             endpoint_signals=smp.endpoint_signals) if smp else
                   PodSample(t.name, t.role, clock(), error=f"no series with {source.pod_label}={t.name!r} and "
                             f"role={t.role!r} (the scrape must set role from app.kubernetes.io/component: "
                             "docs/observability.md)"))
    return out


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


# ---------------------------------------------------------------- status (a report of the decision)
def zero_status(zero: ZeroStep | None, old: dict[str, Any]) -> dict[str, Any] | None:
    """status.autoscaling.scaleToZero (None with scale to zero off). The times outlive the operator's memory: a
    pool still at zero keeps the `since` status already says; leftZeroAt stays until the next return."""
    if zero is None or zero.reason is None and replace(zero.state, served=None) == ZeroState():
        return None
    at_zero = zero.reason in ("ScaledToZero", "AtZero")
    since = old.get("since") if at_zero and old.get("atZero") else None
    if at_zero and since is None and zero.state.zero_since is not None:
        since = iso(zero.state.zero_since)
    left = iso(zero.state.left_zero_at) if zero.state.left_zero_at is not None else old.get("leftZeroAt")
    reason = zero.state.reason if at_zero else None
    return {"atZero": at_zero, "heldRequests": zero.held, **({"reason": reason} if reason else {}),
            **({"since": since} if since else {}), **({"leftZeroAt": left} if left else {})}


def scaling_status(decision: Decision, changes: list[ScalingChange], old: dict[str, Any],
                   dry_run: bool, zero: ZeroStep | None = None) -> dict[str, Any]:
    """status.autoscaling for this decision; lastDecision is the latest change told (kept until the next)."""
    status: dict[str, Any] = {"dryRun": dry_run}
    if (z := zero_status(zero, old.get("scaleToZero") or {})) is not None:
        status["scaleToZero"] = z
    for role, d in decision.roles.items():
        signals = decision.signals.get(role, {})
        status[role] = {"current": d.current, "desired": d.desired, "reason": d.reason,
                        **({"limitedBy": d.limited_by} if d.limited_by else {}),
                        # which metrics the decision could read (vLLM workers lack the disagg: gauges)
                        **({"signalsUsed": signals["used"]} if signals.get("used") else {}),
                        **({"signalsUnavailable": signals["unavailable"]} if signals.get("unavailable") else {})}
    if changes:
        c = changes[-1]
        status["lastDecision"] = {"time": iso(c.time), "role": c.role, "from": c.from_replicas,
                                  "to": c.to_replicas, "reason": c.reason,
                                  **({"bottleneck": decision.bottleneck} if decision.bottleneck else {}),
                                  "dryRun": dry_run, "metrics": status_metrics(decision.metrics)}
    elif old.get("lastDecision"):
        status["lastDecision"] = old["lastDecision"]
    return status


def scaling_conditions(decision: Decision, old: list[dict[str, Any]], generation: int,
                       now: datetime) -> list[dict[str, Any]]:
    """All conditions: the reconcile pass's as they are, the autoscaler's replaced."""
    ours = [{"type": c.type, "status": c.status, "reason": c.reason, "message": c.message,
             "observedGeneration": generation} for c in decision.conditions]
    ours = r.with_transition_times(ours, old, now)
    return [c for c in old if c.get("type") not in s.AUTOSCALING_CONDITIONS] + ours


# ---------------------------------------------------------------- apply
@dataclass
class AutoscaleResult:
    decision: Decision
    state: PassState  # pass to the next call
    interval_seconds: int
    dry_run: bool
    changes: list[ScalingChange] = field(default_factory=list)
    status_written: bool = False
    scaled: list[str] = field(default_factory=list)  # Deployments whose replicas were written
    replicas_reverted: list[r.ReplicasReverted] = field(default_factory=list)  # hand edits undone
    cost_patched: list[str] = field(default_factory=list)  # pods whose deletion cost was set or cleared
    cost_failed: list[str] = field(default_factory=list)  # "pod: error" where that write was refused


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


def _apply(cluster: Cluster, namespace: str, deployments: dict[str, dict[str, Any]],
           pods: dict[str, list[dict[str, Any]]], outcome: PassOutcome, result: AutoscaleResult) -> None:
    """Mark the pods to remove, then write each Deployment's replicas where the decision (or a hand edit to undo)
    asks for it."""
    for role, d in outcome.decision.roles.items():
        dep = deployments[role]
        if role in outcome.removals:
            _mark_victims(cluster, namespace, pods[role], outcome.removals[role], result)
        found = dep.get("spec", {}).get("replicas")
        if found == d.desired and d.current == d.desired:
            continue
        name = dep["metadata"]["name"]
        cluster.patch("apps/v1", "Deployment", namespace, name, r.scale_patch(dep, d.desired))
        result.scaled.append(name)
        if found not in (d.current, d.desired):
            result.replicas_reverted.append(r.ReplicasReverted(name, found, d.desired, REVERTED_SOURCE))


def _read_samples(spec: s.DisaggregatedInferenceSpec, pods: dict[str, list[dict[str, Any]]],
                  clock: Callable[[], float]) -> list[PodSample]:
    """The worker pods' samples, and the router pods' (their per-endpoint view of pending KV hand-offs)."""
    targets = [t for role in (*ROLES, "router") for t in scrape_targets(pods.get(role, []), role)]
    source = spec.autoscaling.metrics_source
    return (from_prometheus(targets, source, clock) if source.type == "prometheus"
            else scrape(targets, source.timeout_seconds, clock))


def autoscale(body: dict[str, Any], cluster: Cluster, state: PassState, now: datetime,
              clock: Callable[[], float]) -> AutoscaleResult | None:
    """One decision for one resource. None: gone, invalid, autoscaling off, or no Deployments yet.
    `clock`: seconds (the samples' timestamps); `now`: the same instant for the conditions."""
    meta = body["metadata"]
    body = cluster.get(s.API_VERSION, s.KIND, meta["namespace"], meta["name"])  # type: ignore[assignment]
    if body is None:
        return None
    spec, problems = r.check(body)
    if spec is None or problems or not spec.autoscaling.builtin():
        return None
    meta = body["metadata"]
    owner = m.Owner(name=meta["name"], namespace=meta["namespace"], uid=meta["uid"])
    deployments = {role: cluster.get("apps/v1", "Deployment", owner.namespace, child_name(owner.name, role))
                   for role in ROLES}
    if any(d is None for d in deployments.values()):
        return None
    current = {role: r.applied_replicas(dep) for role, dep in deployments.items()}  # type: ignore[arg-type]
    pods = {role: cluster.list_objects("v1", "Pod", owner.namespace, label_selector(owner.name, role))
            for role in (*ROLES, "router")}
    dry_run = spec.autoscaling.dry_run
    outcome = run_pass(lambda: _read_samples(spec, pods, clock), {role: removable_pods(pods[role]) for role in ROLES},
                       current, policy_from_spec(spec.autoscaling), state, clock(), dry_run)
    # at zero the routers' held count is read every ZERO_POLL_S: a held request must not wait for the interval
    interval = min(ZERO_POLL_S, spec.autoscaling.interval_seconds) if outcome.at_zero and not dry_run else \
        spec.autoscaling.interval_seconds
    result = AutoscaleResult(outcome.decision, outcome.state, interval, dry_run, outcome.changes)
    if not dry_run:
        _apply(cluster, owner.namespace, deployments, pods, outcome, result)  # type: ignore[arg-type]
    old = body.get("status") or {}
    scaled = scaling_status(outcome.decision, outcome.changes, old.get("autoscaling") or {}, dry_run,
                            outcome.zero)
    conditions = scaling_conditions(outcome.decision, old.get("conditions") or [], int(meta.get("generation", 0)),
                                    now)
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

    def observe(self, namespace: str, name: str, decision: Decision) -> None:
        for role, d in decision.roles.items():
            self.desired_replicas.labels(namespace, name, role).set(d.desired)
            self.decisions.labels(namespace, name, role, d.reason).inc()
