"""The status the reconcile pass writes, rebuilt from the children every pass (pure): replicas per Deployment,
the conditions Ready, Progressing, Degraded and, with the gateway on, InferencePoolReady (what the user's gateway
controller wrote in the InferencePool's status.parents).
"""
from __future__ import annotations

from datetime import datetime
from typing import Any

from disagg.operator.checks import Problem
from disagg.operator.naming import LABEL_REVISION
from disagg.operator.ownership import ChildConflict

# Deployment component -> its key in status; the endpoint picker's only with the gateway on
STATUS_KEYS = {"prefill": "prefill", "decode": "decode", "router": "router", "epp": "endpointPicker"}
ALWAYS = ("prefill", "decode", "router")
POOL_CONDITIONS = ("Accepted", "ResolvedRefs")  # what a GIE gateway writes per parent Gateway


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


def condition(ctype: str, ok: bool | None, reason: str, message: str, generation: int) -> dict[str, Any]:
    """`ok` None: Unknown."""
    return {"type": ctype, "status": "Unknown" if ok is None else "True" if ok else "False", "reason": reason,
            "message": message, "observedGeneration": generation}


def with_transition_times(new: list[dict[str, Any]], old: list[dict[str, Any]], now: datetime) -> list[dict]:
    previous = {c.get("type"): c for c in old}
    stamp = now.strftime("%Y-%m-%dT%H:%M:%SZ")
    for c in new:
        prev = previous.get(c["type"])
        c["lastTransitionTime"] = prev["lastTransitionTime"] if prev and prev.get("status") == c["status"] \
            and prev.get("lastTransitionTime") else stamp
    return new


def pool_condition(pool: dict[str, Any] | None, generation: int) -> dict[str, Any]:
    """InferencePoolReady from status.parents: True when every parent Gateway accepted the pool and resolved its
    references; False naming the first that did not; Unknown/WaitingForGateway until a gateway wrote one."""
    name = (pool or {}).get("metadata", {}).get("name", "?")
    parents = ((pool or {}).get("status") or {}).get("parents") or []
    if not parents:
        return condition("InferencePoolReady", None, "WaitingForGateway", f"no gateway has reported on "
                         f"InferencePool {name} yet (status.parents is empty)", generation)
    waiting = []
    for parent in parents:
        ref = parent.get("parentRef") or {}
        gateway = f"{ref.get('kind', 'Gateway')} {ref.get('namespace') + '/' if ref.get('namespace') else ''}" \
                  f"{ref.get('name', '?')}"
        found = {c.get("type"): c for c in parent.get("conditions") or []}
        for ctype in POOL_CONDITIONS:
            c = found.get(ctype)
            if c is None:
                waiting.append(f"{gateway}: no {ctype} yet")
            elif c.get("status") != "True":
                return condition("InferencePoolReady", False, c.get("reason") or f"Not{ctype}",
                                 f"{gateway}: {ctype}={c.get('status')}: {c.get('message', '')}", generation)
    if waiting:
        return condition("InferencePoolReady", None, "WaitingForGateway", "; ".join(waiting), generation)
    gateways = ", ".join(str((p.get("parentRef") or {}).get("name", "?")) for p in parents)
    return condition("InferencePoolReady", True, "Accepted", f"accepted by {gateways}, references resolved",
                     generation)


def build_status(generation: int, deployments: dict[str, dict | None], desired: dict[str, dict] | None,
                 problems: list[Problem], extra: dict[str, Any], conflicts: list[ChildConflict] | None = None,
                 gateway: bool = False, pool: dict[str, Any] | None = None,
                 scale_selector: bool = False) -> dict[str, Any]:
    """Conditions without transition times; `desired` is None when the spec was rejected (component -> the
    Deployment we want otherwise). With the `gateway` on, `pool` is the InferencePool as the server holds it.
    `scale_selector`: an outside autoscaler drives /scale (autoscaling mode external): the pools' selectors."""
    roles = list(desired) if desired is not None else list(ALWAYS)
    status: dict[str, Any] = {"observedGeneration": generation, **extra,
                              **{STATUS_KEYS[r]: role_status(deployments.get(r)) for r in roles}}
    if problems:
        msg = "; ".join(str(p) for p in problems)
        status["conditions"] = [condition("Ready", False, "InvalidSpec", msg, generation),
                                condition("Progressing", False, "InvalidSpec", msg, generation),
                                condition("Degraded", True, "InvalidSpec", msg, generation)]
        return status
    assert desired is not None
    want = {r: desired[r]["spec"]["replicas"] for r in roles}
    for r in ("prefill", "decode") if scale_selector else ():  # /scale's labelSelectorPath: .status.decode.selector
        labels = desired[r]["spec"]["selector"]["matchLabels"] if r in desired else {}
        status[STATUS_KEYS[r]]["selector"] = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
    counts = ", ".join(f"{r} {status[STATUS_KEYS[r]]['readyReplicas']}/{want[r]}" for r in roles)
    pending = [r for r in roles if not rolled_out(deployments.get(r), desired[r])]
    ready = all(status[STATUS_KEYS[r]]["readyReplicas"] >= want[r] for r in roles)
    progressing = bool(pending)
    conditions = [
        condition("Ready", ready, "ReplicasReady" if ready else "ReplicasNotReady", f"ready: {counts}", generation),
        condition("Progressing", progressing, "RolloutInProgress" if progressing else "RolloutComplete",
                  f"rolling out: {', '.join(pending)}" if pending else "all pools run the current revision",
                  generation),
        condition("Degraded", not progressing and not ready,
                  "ReplicasUnavailable" if not progressing and not ready else "AsExpected", f"ready: {counts}",
                  generation),
    ]
    if conflicts:  # a child we may not write: the resource is not what its spec says
        msg = "; ".join(f"{c}: not adopted" for c in conflicts)
        conditions[0] = condition("Ready", False, "ChildOwnedElsewhere", msg, generation)
        conditions[2] = condition("Degraded", True, "ChildOwnedElsewhere", msg, generation)
    if gateway:
        conditions.append(pool_condition(pool, generation))
    status["conditions"] = conditions
    return status
