"""One level-based pass: observe the children, build the desired state, write only the difference, rebuild
status from what the children report. Knows nothing about kopf; the clock and the API client are injected.

Replicas have one writer each, and status is never read to decide them: with autoscaling off (or in dry run)
this pass applies spec.<role>.replicas; with it on, the autoscaler owns the worker Deployments' spec.replicas
(as an HPA owns its target's scale) and this pass sets them only when it creates a Deployment.

An object of a child's name that another controller owns is never written (a condition and an Event name it);
children the spec no longer wants (the gateway's, the NetworkPolicies turned off) are deleted when this resource
controls them. The hand-off key's Secret is created once, never rewritten (its key is random).
"""
from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Protocol

from disagg.operator import handoff_key
from disagg.operator import manifests as m
from disagg.operator import spec as s
from disagg.operator.checks import Problem, check_spec, name_problems
from disagg.operator.naming import ANNOTATION_LAST_APPLIED, LABEL_COMPONENT, Component, child_name
from disagg.operator.ownership import ChildConflict, conflict, controlled_by
from disagg.operator.plan import autoscaler_owns_replicas, initial_replicas
from disagg.operator.resource_status import (  # noqa: F401 - role_status, rolled_out: this module's API too
    ALWAYS, STATUS_KEYS, build_status, role_status, rolled_out, with_transition_times,
)
from disagg.worker.kv_transfer.handoff_auth import new_key as new_handoff_key

log = logging.getLogger(__name__)

ROLES: tuple[Component, ...] = ALWAYS
# status keys this pass owns; status.autoscaling and the scaling conditions belong to the autoscaler (this pass
# only removes them when autoscaling is switched off)
OWNED_STATUS_KEYS = ("observedGeneration", "revision", "endpoint", *STATUS_KEYS.values(), "conditions")
WORKER_ROLES: tuple[m.Role, ...] = ("prefill", "decode")
# where a Deployment's replicas come from, for the report of a hand edit undone
REPLICAS_SOURCE = {"epp": "spec.gateway.endpointPicker.replicas"}


class Cluster(Protocol):
    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None: ...
    def create(self, obj: dict[str, Any]) -> dict[str, Any]: ...
    def patch(self, api_version: str, kind: str, namespace: str, name: str, patch: dict[str, Any],
              subresource: str | None = None) -> dict[str, Any]: ...
    def delete(self, api_version: str, kind: str, namespace: str, name: str) -> None: ...


@dataclass
class PassResult:
    status: dict[str, Any]  # the status the resource now has
    status_written: bool
    children_written: list[str] = field(default_factory=list)  # "Kind/name" created or patched
    problems: list[Problem] = field(default_factory=list)  # non-empty: spec rejected, children untouched
    replicas_reverted: list[ReplicasReverted] = field(default_factory=list)  # hand edits undone
    conflicts: list[ChildConflict] = field(default_factory=list)  # children another controller owns: untouched
    children_removed: list[str] = field(default_factory=list)  # "Kind/name" the spec no longer wants, deleted


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


# ---------------------------------------------------------------- the pass
def check(body: dict[str, Any]) -> tuple[s.DisaggregatedInferenceSpec | None, list[Problem]]:
    spec, problems = check_spec(body.get("spec") or {}, "kubernetes")
    return spec, name_problems(body["metadata"]["name"]) + problems


@dataclass
class _Applied:
    written: list[str] = field(default_factory=list)  # "Kind/name" created or patched
    reverted: list[ReplicasReverted] = field(default_factory=list)
    deployments: dict[str, dict | None] = field(default_factory=dict)  # component -> as the server holds it
    desired: dict[str, dict] | None = None  # component -> the Deployment we want; None: spec rejected
    conflicts: list[ChildConflict] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)  # "Kind/name" deleted
    pool: dict[str, Any] | None = None  # the InferencePool as the server holds it


def ensure_handoff_secret(cluster: Cluster, owner: m.Owner, spec: s.DisaggregatedInferenceSpec,
                          new_key: Callable[[], str], out: _Applied) -> None:
    """Secret <name>-handoff: created with a fresh key when missing, never rewritten (pods hold the key: a new
    one would refuse the hand-offs in flight). None when spec.security.handoffKeySecret names the user's."""
    if not handoff_key.operator_creates_secret(spec):
        return
    name = child_name(owner.name, "handoff")
    observed = cluster.get("v1", "Secret", owner.namespace, name)
    if observed is None:
        cluster.create(handoff_key.build_handoff_secret(owner, new_key()))
        out.written.append(f"Secret/{name}")
    elif (c := conflict("Secret", observed, owner.uid)) is not None:
        out.conflicts.append(c)


def remove_unwanted(cluster: Cluster, owner: m.Owner, spec: s.DisaggregatedInferenceSpec,
                    wanted: set[tuple[str, str]], out: _Applied) -> None:
    """Delete the children this resource may have but its spec no longer wants, where this resource controls
    them (the gateway's when it is turned off, the NetworkPolicies when they are)."""
    for api_version, kind, name in m.possible_children(owner, spec):
        if (kind, name) in wanted:
            continue
        observed = cluster.get(api_version, kind, owner.namespace, name)
        if observed is not None and controlled_by(observed, owner.uid):
            cluster.delete(api_version, kind, owner.namespace, name)
            out.removed.append(f"{kind}/{name}")


def apply_children(cluster: Cluster, owner: m.Owner, spec: s.DisaggregatedInferenceSpec,
                   new_key: Callable[[], str] = new_handoff_key) -> _Applied:
    owned_elsewhere = autoscaler_owns_replicas(spec)
    spec = spec.model_copy(deep=True)
    for role in WORKER_ROLES:  # with the autoscaler on, only the starting point: the Deployment's creation
        getattr(spec, role).replicas = initial_replicas(spec, role)
    out = _Applied(desired={})
    ensure_handoff_secret(cluster, owner, spec, new_key, out)  # before the pods that read it
    wanted: set[tuple[str, str]] = set()
    for child in m.desired_children(owner, spec):
        meta = child["metadata"]
        wanted.add((child["kind"], meta["name"]))
        observed = cluster.get(child["apiVersion"], child["kind"], meta["namespace"], meta["name"])
        role = meta["labels"].get(LABEL_COMPONENT) if child["kind"] == "Deployment" else None
        if observed is not None and (c := conflict(child["kind"], observed, owner.uid)) is not None:
            out.conflicts.append(c)  # not ours to write: reported, and counted as not there
            if role is not None:
                out.deployments[role], out.desired[role] = None, child
            continue
        keep = owned_elsewhere and role in WORKER_ROLES and observed is not None
        if keep:  # the autoscaler's number, as it last applied it
            child["spec"]["replicas"] = applied_replicas(observed)  # type: ignore[arg-type]
        found = hand_set_replicas(child, observed) if observed is not None and not keep else None
        current, wrote = apply_child(cluster, child, observed, keep_replicas=keep)
        if wrote:
            out.written.append(f"{child['kind']}/{meta['name']}")
        if child["kind"] == "InferencePool":
            out.pool = current
        if role is not None:
            out.deployments[role], out.desired[role] = current, child
            if found is not None:
                out.reverted.append(ReplicasReverted(meta["name"], found, child["spec"]["replicas"],
                                                     REPLICAS_SOURCE.get(role, f"spec.{role}.replicas")))
    remove_unwanted(cluster, owner, spec, wanted, out)
    return out


def reconcile(body: dict[str, Any], cluster: Cluster, now: datetime,
              new_key: Callable[[], str] = new_handoff_key) -> PassResult | None:
    """`body` says which resource; the pass reads it afresh (a trigger's copy may predate our last status
    write). None: the resource is gone. `new_key`: the hand-off key of a Secret the pass creates."""
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
        applied = apply_children(cluster, owner, spec, new_key)
        extra = {"revision": m.serving_revision(spec), "endpoint": m.router_endpoint(owner, spec)}
    written, reverted = applied.written, applied.reverted
    gateway = spec is not None and not problems and spec.gateway.enabled
    external = spec is not None and not problems and spec.autoscaling.enabled and spec.autoscaling.mode == "external"
    status = build_status(generation, applied.deployments, applied.desired, problems, extra, applied.conflicts,
                          gateway, applied.pool, scale_selector=external)
    status["conditions"] = with_transition_times(status["conditions"], old_status.get("conditions") or [], now)
    autoscaling_on = spec is not None and spec.autoscaling.builtin()
    if autoscaling_on:  # the autoscaler's conditions stay, after ours
        status["conditions"] += [c for c in old_status.get("conditions") or []
                                 if c.get("type") in s.AUTOSCALING_CONDITIONS]
    owned = {k: v for k, v in old_status.items() if k in OWNED_STATUS_KEYS}
    stale_autoscaling = not autoscaling_on and spec is not None and "autoscaling" in old_status
    result = PassResult(old_status, False, written, problems, reverted, applied.conflicts, applied.removed)
    if owned == status and not stale_autoscaling:
        return result
    patch = merge_patch(owned, status)
    if stale_autoscaling:
        patch["autoscaling"] = None
    cluster.patch(s.API_VERSION, s.KIND, owner.namespace, owner.name, {"status": patch}, subresource="status")
    result.status = {k: v for k, v in {**old_status, **status}.items()
                     if not (stale_autoscaling and k == "autoscaling")}
    result.status_written = True
    return result
