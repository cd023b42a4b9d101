"""One level-based pass: observe the children, build the desired state, write only the difference, rebuild
status from what the children report. Knows nothing about kopf; the clock and the API client are injected.

Replicas have one writer each, and status is never read to decide them: with autoscaling off (or in dry run)
this pass applies spec.<role>.replicas; with it on, the autoscaler owns the worker Deployments' spec.replicas
(as an HPA owns its target's scale) and this pass sets them only when it creates a Deployment.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Protocol

from disagg.operator import manifests as m
from disagg.operator import spec as s
from disagg.operator.checks import Problem, check_spec, name_problems
from disagg.operator.naming import ANNOTATION_LAST_APPLIED, LABEL_COMPONENT, LABEL_REVISION, Component, child_name
from disagg.operator.plan import autoscaler_owns_replicas, initial_replicas

log = logging.getLogger(__name__)

ROLES: tuple[Component, ...] = ("prefill", "decode", "router")
# status keys this pass owns; status.autoscaling and the scaling conditions belong to the autoscaler (this pass
# only removes them when autoscaling is switched off)
OWNED_STATUS_KEYS = ("observedGeneration", "revision", "endpoint", *ROLES, "conditions")
WORKER_ROLES: tuple[m.Role, ...] = ("prefill", "decode")


class Cluster(Protocol):
    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None: ...
    def create(self, obj: dict[str, Any]) -> dict[str, Any]: ...
    def patch(self, api_version: str, kind: str, namespace: str, name: str, patch: dict[str, Any],
              subresource: str | None = None) -> dict[str, Any]: ...


@dataclass
class PassResult:
    status: dict[str, Any]  # the status the resource now has
    status_written: bool
    children_written: list[str] = field(default_factory=list)  # "Kind/name" created or patched
    problems: list[Problem] = field(default_factory=list)  # non-empty: spec rejected, children untouched
    replicas_reverted: list[ReplicasReverted] = field(default_factory=list)  # hand edits undone


@dataclass(frozen=True)
class ReplicasReverted:
    deployment: str  # name
    found: int  # replicas someone else set
    restored: int  # what the operator wrote back
    source: str  # where the restored number comes from, e.g. "spec.decode.replicas"


# ---------------------------------------------------------------- children
def _canonical(obj: dict[str, Any]) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


def _stamped(desired: dict[str, Any]) -> dict[str, Any]:
    """The desired object carrying the JSON of itself in an annotation (canonical, without that annotation)."""
    out = json.loads(json.dumps(desired))
    out["metadata"].setdefault("annotations", {})[ANNOTATION_LAST_APPLIED] = _canonical(desired)
    return out


def _last_applied(observed: dict[str, Any]) -> dict[str, Any]:
    text = (observed.get("metadata", {}).get("annotations") or {}).get(ANNOTATION_LAST_APPLIED)
    try:
        return json.loads(text) if text else {}
    except ValueError:
        return {}


def merge_patch(last: Any, desired: Any) -> Any:
    """A JSON merge patch that makes the object hold `desired` and drops keys we applied before but no longer
    want (null). Keys others set (server defaults, status) are left alone."""
    if isinstance(last, dict) and isinstance(desired, dict):
        out = {k: merge_patch(last.get(k), v) for k, v in desired.items()}
        out.update({k: None for k in last if k not in desired})
        return out
    return desired


def applied_replicas(deployment: dict[str, Any]) -> int:
    """The replicas the operator last applied to a Deployment (by this pass or a scale), else what it holds."""
    applied = _last_applied(deployment).get("spec", {}).get("replicas")
    return int(applied if applied is not None else deployment.get("spec", {}).get("replicas", 0))


def scale_patch(deployment: dict[str, Any], replicas: int) -> dict[str, Any]:
    """The merge patch that scales a Deployment we applied, keeping its last-applied annotation true."""
    patch: dict[str, Any] = {"spec": {"replicas": replicas}}
    last = _last_applied(deployment)
    if last:
        last.setdefault("spec", {})["replicas"] = replicas
        patch["metadata"] = {"annotations": {ANNOTATION_LAST_APPLIED: _canonical(last)}}
    return patch


def child_needs_write(desired: dict[str, Any], observed: dict[str, Any], live_replicas: bool = True) -> bool:
    if _last_applied(observed) != desired:
        return True
    # replicas are compared live: a hand `kubectl scale` is drift the operator undoes (unless the autoscaler owns
    # them: live_replicas False)
    return live_replicas and desired["kind"] == "Deployment" and \
        observed.get("spec", {}).get("replicas") != desired["spec"]["replicas"]


def hand_set_replicas(desired: dict[str, Any], observed: dict[str, Any]) -> int | None:
    """The replicas someone else (kubectl scale, an HPA) set on a Deployment we last applied with the replicas we
    still want; None when there is no such edit (or the change is ours: the wanted replicas moved)."""
    if desired["kind"] != "Deployment":
        return None
    found, want = observed.get("spec", {}).get("replicas"), desired["spec"]["replicas"]
    applied = _last_applied(observed).get("spec", {}).get("replicas")
    return found if found != want and applied == want else None


def apply_child(cluster: Cluster, desired: dict[str, Any], observed: dict[str, Any] | None,
                keep_replicas: bool = False) -> tuple[dict[str, Any], bool]:
    """Returns (the object as the server now holds it, whether we wrote). `observed`: the child as just read,
    None when it does not exist. `keep_replicas`: someone else (the autoscaler) writes spec.replicas; `desired`
    then carries applied_replicas(observed) and the patch leaves the live number alone."""
    meta = desired["metadata"]
    key = (desired["apiVersion"], desired["kind"], meta["namespace"], meta["name"])
    if observed is None:
        return cluster.create(_stamped(desired)), True  # 409 if created meanwhile: transient, next pass patches
    if not child_needs_write(desired, observed, live_replicas=not keep_replicas):
        return observed, False
    patch = merge_patch(_last_applied(observed), desired)
    if keep_replicas:  # a new dict: merge_patch may hand back parts of `desired` itself
        patch["spec"] = {k: v for k, v in patch["spec"].items() if k != "replicas"}
    patch["metadata"].setdefault("annotations", {})[ANNOTATION_LAST_APPLIED] = \
        _stamped(desired)["metadata"]["annotations"][ANNOTATION_LAST_APPLIED]
    return cluster.patch(*key, patch), True


# ---------------------------------------------------------------- status
def role_status(deployment: dict[str, Any] | None) -> dict[str, int]:
    st = (deployment or {}).get("status") or {}
    return {"replicas": int(st.get("replicas", 0)), "readyReplicas": int(st.get("readyReplicas", 0)),
            "updatedReplicas": int(st.get("updatedReplicas", 0))}


def rolled_out(deployment: dict[str, Any] | None, desired: dict[str, Any]) -> bool:
    """Every pod runs the template (revision) we want now. Availability is not asked: pods failing /ready
    after a finished rollout are Degraded, not Progressing."""
    if deployment is None:
        return False
    want = desired["spec"]["replicas"]
    st = deployment.get("status") or {}
    template_labels = deployment.get("spec", {}).get("template", {}).get("metadata", {}).get("labels", {})
    wanted_labels = desired["spec"]["template"]["metadata"]["labels"]
    return (st.get("observedGeneration", -1) >= deployment["metadata"].get("generation", 0)
            and template_labels.get(LABEL_REVISION) == wanted_labels.get(LABEL_REVISION)
            and st.get("updatedReplicas", 0) == want and st.get("replicas", 0) == want)


def _condition(ctype: str, ok: bool, reason: str, message: str, generation: int) -> dict[str, Any]:
    return {"type": ctype, "status": "True" if ok else "False", "reason": reason, "message": message,
            "observedGeneration": generation}


def with_transition_times(new: list[dict[str, Any]], old: list[dict[str, Any]], now: datetime) -> list[dict]:
    previous = {c.get("type"): c for c in old}
    stamp = now.strftime("%Y-%m-%dT%H:%M:%SZ")
    for c in new:
        prev = previous.get(c["type"])
        c["lastTransitionTime"] = prev["lastTransitionTime"] if prev and prev.get("status") == c["status"] \
            and prev.get("lastTransitionTime") else stamp
    return new


def build_status(generation: int, deployments: dict[str, dict | None], desired: dict[str, dict] | None,
                 problems: list[Problem], extra: dict[str, Any]) -> dict[str, Any]:
    """Conditions without transition times; `desired` is None when the spec was rejected."""
    status: dict[str, Any] = {"observedGeneration": generation, **extra,
                              **{r: role_status(deployments.get(r)) for r in ROLES}}
    if problems:
        msg = "; ".join(str(p) for p in problems)
        status["conditions"] = [_condition("Ready", False, "InvalidSpec", msg, generation),
                                _condition("Progressing", False, "InvalidSpec", msg, generation),
                                _condition("Degraded", True, "InvalidSpec", msg, generation)]
        return status
    assert desired is not None
    want = {r: desired[r]["spec"]["replicas"] for r in ROLES}
    counts = ", ".join(f"{r} {status[r]['readyReplicas']}/{want[r]}" for r in ROLES)
    pending = [r for r in ROLES if not rolled_out(deployments.get(r), desired[r])]
    ready = all(status[r]["readyReplicas"] >= want[r] for r in ROLES)
    progressing = bool(pending)
    status["conditions"] = [
        _condition("Ready", ready, "ReplicasReady" if ready else "ReplicasNotReady", f"ready: {counts}", generation),
        _condition("Progressing", progressing, "RolloutInProgress" if progressing else "RolloutComplete",
                   f"rolling out: {', '.join(pending)}" if pending else "all pools run the current revision",
                   generation),
        _condition("Degraded", not progressing and not ready,
                   "ReplicasUnavailable" if not progressing and not ready else "AsExpected", f"ready: {counts}",
                   generation),
    ]
    return status


# ---------------------------------------------------------------- the pass
def check(body: dict[str, Any]) -> tuple[s.DisaggregatedInferenceSpec | None, list[Problem]]:
    spec, problems = check_spec(body.get("spec") or {}, "kubernetes")
    return spec, name_problems(body["metadata"]["name"]) + problems


@dataclass
class _Applied:
    written: list[str] = field(default_factory=list)  # "Kind/name" created or patched
    reverted: list[ReplicasReverted] = field(default_factory=list)
    deployments: dict[str, dict | None] = field(default_factory=dict)  # role -> as the server holds it
    desired: dict[str, dict] | None = None  # role -> the Deployment we want; None: spec rejected


def apply_children(cluster: Cluster, owner: m.Owner, spec: s.DisaggregatedInferenceSpec) -> _Applied:
    owned_elsewhere = autoscaler_owns_replicas(spec)
    spec = spec.model_copy(deep=True)
    for role in WORKER_ROLES:  # with the autoscaler on, only the starting point: the Deployment's creation
        getattr(spec, role).replicas = initial_replicas(spec, role)
    out = _Applied(desired={})
    for child in m.desired_children(owner, spec):
        meta = child["metadata"]
        observed = cluster.get(child["apiVersion"], child["kind"], meta["namespace"], meta["name"])
        role = meta["labels"].get(LABEL_COMPONENT) if child["kind"] == "Deployment" else None
        keep = owned_elsewhere and role in WORKER_ROLES and observed is not None
        if keep:  # the autoscaler's number, as it last applied it
            child["spec"]["replicas"] = applied_replicas(observed)  # type: ignore[arg-type]
        found = hand_set_replicas(child, observed) if observed is not None and not keep else None
        current, wrote = apply_child(cluster, child, observed, keep_replicas=keep)
        if wrote:
            out.written.append(f"{child['kind']}/{meta['name']}")
        if role is not None:
            out.deployments[role], out.desired[role] = current, child
            if found is not None:
                out.reverted.append(ReplicasReverted(meta["name"], found, child["spec"]["replicas"],
                                                     f"spec.{role}.replicas"))
    return out


def reconcile(body: dict[str, Any], cluster: Cluster, now: datetime) -> PassResult | None:
    """`body` says which resource; the pass reads it afresh (a trigger's copy may predate our last status
    write). None: the resource is gone."""
    meta = body["metadata"]
    body = cluster.get(s.API_VERSION, s.KIND, meta["namespace"], meta["name"])  # type: ignore[assignment]
    if body is None:
        return None
    meta = body["metadata"]
    owner = m.Owner(name=meta["name"], namespace=meta["namespace"], uid=meta["uid"])
    generation = int(meta.get("generation", 0))
    spec, problems = check(body)
    old_status = body.get("status") or {}
    applied = _Applied()
    extra: dict[str, Any] = {}
    if problems or spec is None:
        for r in ROLES:  # report what runs, touch nothing
            applied.deployments[r] = cluster.get("apps/v1", "Deployment", owner.namespace, child_name(owner.name, r))
    else:
        applied = apply_children(cluster, owner, spec)
        extra = {"revision": m.serving_revision(spec), "endpoint": m.router_endpoint(owner, spec)}
    written, reverted = applied.written, applied.reverted
    status = build_status(generation, applied.deployments, applied.desired, problems, extra)
    status["conditions"] = with_transition_times(status["conditions"], old_status.get("conditions") or [], now)
    autoscaling_on = spec is not None and spec.autoscaling.enabled
    if autoscaling_on:  # the autoscaler's conditions stay, after ours
        status["conditions"] += [c for c in old_status.get("conditions") or []
                                 if c.get("type") in s.AUTOSCALING_CONDITIONS]
    owned = {k: v for k, v in old_status.items() if k in OWNED_STATUS_KEYS}
    stale_autoscaling = not autoscaling_on and spec is not None and "autoscaling" in old_status
    if owned == status and not stale_autoscaling:
        return PassResult(old_status, False, written, problems, reverted)
    patch = merge_patch(owned, status)
    if stale_autoscaling:
        patch["autoscaling"] = None
    cluster.patch(s.API_VERSION, s.KIND, owner.namespace, owner.name, {"status": patch}, subresource="status")
    new_status = {k: v for k, v in {**old_status, **status}.items() if not (stale_autoscaling and k == "autoscaling")}
    return PassResult(new_status, True, written, problems, reverted)
