"""Autoscaling policy for the prefill and decode pools: a pure function of samples, replicas, policy, history and
the clock (`decide`). No I/O, no hidden state: the history goes in and the updated history comes back.

Per role it is the HPA algorithm (desired = ceil(current x value / target) per metric, the largest wins, nothing
inside the tolerance; stabilization windows; a step limit; min/max) plus what the KV-transfer metrics tell:
- DecodeBound: decode over its targets, or KV waiting at prefill to be pulled (disagg:kv_pending_sends, expired
  leases) while transfers are fast. Prefill never scales up then: its queue is decode's back-pressure.
- TransferBound: transfers slow or failing while both pools are within their targets. Nothing scales up: more pods
  do not add fabric bandwidth.
- PrefillBound: prefill over its targets with no KV back-pressure.
With scale_up_lookahead_seconds (the pods' start-up time) the policy is start-up aware:
- starting pods (current replicas without a fresh sample: only ready pods are scraped) count as capacity on the
  way, as HPA treats unready pods: per-pod values are scaled from the ready pods, no scale-up they already cover;
- scale-up also acts on demand projected one start-up ahead from the growth since the previous decision
  (`project`): prefill from arrival vs measured throughput in prompt tokens, decode from KV usage's growth.
  Scale-down never follows a projection; prefill's measured throughput keeps it from going below the pods the
  arrival needs at policy.prefill_utilization.
Missing or stale samples -> hold (current replicas, clamped into min/max), with a condition naming the pods.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from disagg.operator.autoscaling.classify import Classification, RoleLevels, classify, project
from disagg.operator.autoscaling.inputs import ROLES, AutoscalePolicy, RoleMetrics, aggregate_role, is_fresh
from disagg.operator.autoscaling.samples import PodSample


# ---------------------------------------------------------------- history and decision
@dataclass(frozen=True)
class Recommendation:
    time: float  # seconds, the injected clock
    replicas: int  # the role's recommendation before stabilization


@dataclass
class ScalingHistory:
    """What the stabilization windows and windowed latencies need from earlier decisions."""

    recommendations: dict[str, list[Recommendation]] = field(default_factory=dict)  # role -> oldest first
    last_samples: dict[str, PodSample] = field(default_factory=dict)  # pod -> its previous fresh sample
    levels: dict[str, RoleLevels] = field(default_factory=dict)  # role -> its levels at the previous decision
    # the first decision's time: a scale-down window that reaches back before it (a fresh start, an operator restart
    # or failover - the history lives in memory) assumes the current size was recommended then, so no scale-down
    # happens until one whole window has been seen
    since: float | None = None


@dataclass(frozen=True)
class ScalingCondition:
    type: str  # ScalingActive | ScalingLimited | TransferBound
    status: str  # "True" | "False"
    reason: str  # one CamelCase word
    message: str = ""


@dataclass
class RoleDecision:
    current: int
    desired: int
    reason: str  # PrefillBound, DecodeBound, TransferBound, Underutilized, WithinTolerance, ScaleDownStabilizing,
    #              MetricsMissing, MetricsStale
    recommendation: int  # before stabilization, step limit, min/max and ratio bounds
    limited_by: str | None = None  # TooFewReplicas | TooManyReplicas | StepLimited | RatioBound


@dataclass
class Decision:
    time: float
    bottleneck: str | None  # PrefillBound | DecodeBound | TransferBound | PrefillAndDecodeBound | None
    reason: str  # one CamelCase word for the whole decision
    roles: dict[str, RoleDecision]
    metrics: dict[str, float | None]  # the values compared with targets, by name
    conditions: list[ScalingCondition]
    history: ScalingHistory  # pass to the next decide()
    # role -> ("used" | "unavailable") -> signal names (inputs.SIGNALS): what this decision could read
    signals: dict[str, dict[str, list[str]]] = field(default_factory=dict)
    # role -> the signals its recommendation came from, or that held it back (classify.Classification.decided_by)
    decided_by: dict[str, list[str]] = field(default_factory=dict)

    @property
    def desired(self) -> dict[str, int]:
        return {r: d.desired for r, d in self.roles.items()}


def decide(samples_by_role: dict[str, list[PodSample]], current_replicas: dict[str, int], policy: AutoscalePolicy,
           history: ScalingHistory, now: float) -> Decision:
    """One autoscaling decision for both pools."""
    if history.since is None:
        history = replace(history, since=now)
    previous = history.last_samples
    rms = {r: aggregate_role(r, samples_by_role.get(r, []), previous, now, policy) for r in ROLES}
    last = dict(previous)
    for r in ROLES:
        for s in samples_by_role.get(r, []):
            if is_fresh(s, now, policy):
                last[s.pod] = s
    history = replace(history, last_samples=last)
    bad = _metrics_problem(rms, current_replicas)
    if bad is not None:
        decision = hold_decision(bad[0], bad[1], rms, current_replicas, policy, history, now)
    else:
        projected, levels = project(rms, current_replicas, policy, history.levels, now)
        history = replace(history, levels=levels)
        decision = scale_decision(classify(rms, current_replicas, policy, projected), rms, current_replicas, policy,
                                  history, now)
    decision.signals = {r: {"used": rms[r].signals_used, "unavailable": rms[r].signals_unavailable} for r in ROLES}
    return decision


def _metrics_problem(rms: dict[str, RoleMetrics], current: dict[str, int]) -> tuple[str, str] | None:
    missing = [f"{r}: {p}" for r in ROLES for p in rms[r].missing + rms[r].absent]
    missing += [f"{r}: no samples for {current.get(r, 0)} replicas" for r in ROLES
                if rms[r].pods == 0 and not rms[r].stale and current.get(r, 0) > 0]
    if missing:
        return "MetricsMissing", "; ".join(missing)
    stale = [f"{r}: {p}" for r in ROLES for p in rms[r].stale]
    if stale:
        return "MetricsStale", "; ".join(stale)
    return None


# ---------------------------------------------------------------- stabilization, limits, bounds
def _stabilize(role: str, rec: int, current: int, policy: AutoscalePolicy, history: ScalingHistory,
               now: float) -> tuple[int, list[Recommendation]]:
    """HPA: scale up to the lowest recommendation of the up window, down to the highest of the down window."""
    keep = max(policy.scale_up_window_seconds, policy.scale_down_window_seconds)
    recs = [r for r in history.recommendations.get(role, []) if now - r.time <= keep]
    recs.append(Recommendation(now, rec))
    up = min(r.replicas for r in recs if now - r.time <= policy.scale_up_window_seconds)
    down = max(r.replicas for r in recs if now - r.time <= policy.scale_down_window_seconds)
    if history.since is not None and now - history.since < policy.scale_down_window_seconds:
        down = max(down, current)  # the window reaches back before this history began (see ScalingHistory.since)
    return (up if up > current else down if down < current else current), recs


def _clamp(role: str, value: int, policy: AutoscalePolicy) -> tuple[int, str | None]:
    b = policy.bounds(role)
    if value < b.min_replicas:
        return b.min_replicas, "TooFewReplicas"
    if value > b.max_replicas:
        return b.max_replicas, "TooManyReplicas"
    return value, None


def _apply_ratio_bounds(want: dict[str, int], policy: AutoscalePolicy) -> set[str]:
    """Keep prefill/decode inside [ratio_min, ratio_max]: raise the role that is behind (up to its max), then lower
    the role that is ahead if still needed (availability before cost). Returns the roles changed."""
    changed: set[str] = set()
    for bound, ahead, behind in ((policy.ratio_min, "decode", "prefill"), (policy.ratio_max, "prefill", "decode")):
        if bound is None:
            continue
        per = {"prefill": bound[0], "decode": bound[1]}  # the allowed ratio in each role's units
        if want[ahead] * per[behind] <= per[ahead] * want[behind]:
            continue
        need = math.ceil(want[ahead] * per[behind] / per[ahead])
        raised = min(need, policy.bounds(behind).max_replicas)
        if raised > want[behind]:
            want[behind] = raised
            changed.add(behind)
        if want[ahead] * per[behind] > per[ahead] * want[behind]:
            want[ahead] = max(policy.bounds(ahead).min_replicas, want[behind] * per[ahead] // per[behind])
            changed.add(ahead)
    return changed


def scale_decision(c: Classification, rms: dict[str, RoleMetrics], current: dict[str, int],
                   policy: AutoscalePolicy, history: ScalingHistory, now: float) -> Decision:
    roles: dict[str, RoleDecision] = {}
    recs: dict[str, list[Recommendation]] = {}
    for role in ROLES:
        cur, rec = current.get(role, 0), c.recommendation[role]
        stab, recs[role] = _stabilize(role, rec, cur, policy, history, now)
        reason = c.reasons[role]
        if rec < cur and stab >= cur:
            reason = "ScaleDownStabilizing"
        elif rec > cur and stab <= cur:
            reason = "ScaleUpStabilizing"
        limited = None
        step = policy.max_step
        if stab > cur and policy.max_step_percent is not None:
            step = max(step, math.ceil(cur * policy.max_step_percent / 100 - 1e-9))
        if abs(stab - cur) > step:
            stab, limited = cur + step * (1 if stab > cur else -1), "StepLimited"
        desired, clamped = _clamp(role, stab, policy)
        roles[role] = RoleDecision(cur, desired, reason, rec, clamped or limited)
    want = {r: roles[r].desired for r in ROLES}
    for role in _apply_ratio_bounds(want, policy):
        roles[role].desired, roles[role].limited_by = want[role], "RatioBound"
    history = replace(history, recommendations=recs)
    return Decision(now, c.bottleneck, _overall_reason(c.bottleneck, roles), roles, c.metrics,
                    _conditions(None, c, roles), history, decided_by=c.decided_by)


def _overall_reason(bottleneck: str | None, roles: dict[str, RoleDecision]) -> str:
    if bottleneck is not None:
        return bottleneck
    reasons = [d.reason for d in roles.values()]
    for r in ("Underutilized", "ScaleDownStabilizing", "ScaleUpStabilizing"):
        if r in reasons:
            return r
    return "WithinTolerance"


def _conditions(hold: tuple[str, str] | None, c: Classification | None,
                roles: dict[str, RoleDecision]) -> list[ScalingCondition]:
    if hold is not None:
        active = ScalingCondition("ScalingActive", "False", hold[0], hold[1])
    else:
        by = "; ".join(f"{role} by {', '.join(names)}" for role, names in c.decided_by.items() if names)
        active = ScalingCondition("ScalingActive", "True", "ValidMetrics",
                                  (f"bottleneck: {c.bottleneck}" if c.bottleneck else "no bottleneck")
                                  + (f"; {by}" if by else ""))
    limited = [(r, d) for r, d in roles.items() if d.limited_by]
    limit = (ScalingCondition("ScalingLimited", "True", limited[0][1].limited_by,
                              "; ".join(f"{r}: {d.limited_by} at {d.desired}" for r, d in limited)) if limited
             else ScalingCondition("ScalingLimited", "False", "DesiredWithinRange"))
    if c is not None and c.bottleneck == "TransferBound":
        transfer = ScalingCondition("TransferBound", "True", "TransferBound",
                                    c.transfer_message + " while both pools are within their targets; holding")
    else:
        transfer = ScalingCondition("TransferBound", "False", "TransfersWithinTarget" if c else hold[0],
                                    c.transfer_message if c else "")
    return [active, limit, transfer]


def hold_decision(reason: str, message: str, rms: dict[str, RoleMetrics], current: dict[str, int],
                  policy: AutoscalePolicy, history: ScalingHistory, now: float) -> Decision:
    """Missing or stale metrics: keep the current replicas (moved into min/max), record no recommendation."""
    roles = {}
    for role in ROLES:
        cur = current.get(role, 0)
        desired, clamped = _clamp(role, cur, policy)
        roles[role] = RoleDecision(cur, desired, reason, cur, clamped)
    return Decision(now, None, reason, roles, {}, _conditions((reason, message), None, roles), history)
