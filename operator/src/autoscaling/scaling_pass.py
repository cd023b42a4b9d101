"""One autoscaling pass, the same for the operator and for `disagg up`: scrape -> decide -> choose the members to
remove -> report. Only applying the outcome differs: cluster.py patches the Deployments' replicas and marks the
pods to remove; disagg.worker.local.scaling starts and retires worker processes.

The scrape is injected (pods' /metrics or Prometheus in a cluster, processes' /metrics locally), and so is the
clock; what one pass hands the next (`PassState`) lives in the caller's memory, never in status. `disagg up`
imports the pass and what it needs around it (the policy from the spec, scraping /metrics, the report) from here.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from disagg.operator.autoscaling.inputs import ROLES, AutoscalePolicy, policy_from_spec
from disagg.operator.autoscaling.policy import Decision, ScalingHistory, decide
from disagg.operator.autoscaling.report import ScalingChange, decision_json, iso, role_metrics, scaling_line
from disagg.operator.autoscaling.samples import PodSample, attribute_handoff_signals, pod_load
from disagg.operator.autoscaling.sources import scrape_pods
from disagg.operator.autoscaling.zero import ZeroState, ZeroStep, zero_step

__all__ = ["ROLES", "Decision", "PassOutcome", "PassState", "PodSample", "ScalingChange", "choose_removals",
           "decision_json", "iso", "policy_from_spec", "run_pass", "scaling_line", "scrape_pods"]


@dataclass(frozen=True)
class PassState:
    """What one pass leaves for the next."""

    history: ScalingHistory = field(default_factory=ScalingHistory)  # the policy's (stabilization, windows)
    reported: dict[str, tuple[int, int]] = field(default_factory=dict)  # role -> (from, to) told in dry run
    zero: ZeroState = field(default_factory=ZeroState)  # scale to zero: idle since, at zero since (zero.py)


@dataclass
class PassOutcome:
    decision: Decision
    samples: list[PodSample]  # this pass's reads, all roles
    changes: list[ScalingChange]  # pool changes to apply and tell; in dry run a would-be change is told once
    removals: dict[str, list[str]]  # role -> members to remove, in order (never in dry run)
    state: PassState  # pass to the next run_pass()
    zero: ZeroStep | None = None  # scale to zero's part in this decision (zero.py)

    @property
    def at_zero(self) -> bool:
        """The pools are (to be) at zero: poll the routers' held count often, not every interval."""
        return all(d.desired == 0 for d in self.decision.roles.values())


def choose_removals(candidates: Sequence[str], samples: list[PodSample], count: int) -> list[str]:
    """The `count` members to remove: those without a fresh sample first (starting: they hold no work yet), then
    the least loaded (samples.pod_load); ties keep the candidates' order (callers list the newest first)."""
    loads = {s.pod: pod_load(s) for s in samples if not s.missing}
    ranked = sorted(candidates, key=lambda name: (name in loads, loads.get(name, 0.0)))
    return ranked[:max(0, count)]


def run_pass(scrape: Callable[[], list[PodSample]], members: dict[str, list[str]], current: dict[str, int],
             policy: AutoscalePolicy, state: PassState, now: float, dry_run: bool) -> PassOutcome:
    """`members`: role -> the pool's members that may be removed, newest first; `current`: role -> the replicas
    the pool is meant to run (what the decision starts from); `now`: seconds, the samples' clock."""
    samples = attribute_handoff_signals(scrape())  # routers' pages name the workers' pending KV (any engine)
    by_role = {role: [s for s in samples if s.role == role] for role in ROLES}
    decision = decide(by_role, current, policy, state.history, now)
    zero = zero_step(policy.idle_to_zero_seconds, {r: policy.bounds(r).min_replicas for r in ROLES}, samples,
                     current, state.zero, now)
    for role, replicas in (zero.desired or {}).items():  # at zero, or leaving or entering it: not the policy's
        d = decision.roles[role]
        d.desired, d.reason, d.limited_by = replicas, zero.reason, None
        decision.reason = zero.reason
    changes: list[ScalingChange] = []
    removals: dict[str, list[str]] = {}
    reported: dict[str, tuple[int, int]] = {}
    for role, d in decision.roles.items():
        if d.desired == d.current:
            continue
        told = (d.current, d.desired)
        if dry_run:
            reported[role] = told
            if state.reported.get(role) == told:
                continue  # nothing changes in a dry run: tell a would-be change once, not every interval
        changes.append(ScalingChange(role, d.current, d.desired, d.reason, dry_run, now,
                                     role_metrics(decision, role), decision.decided_by.get(role, [])))
        if not dry_run and d.desired < d.current:
            removals[role] = choose_removals(members.get(role, []), by_role[role], d.current - d.desired)
    return PassOutcome(decision, samples, changes, removals, PassState(decision.history, reported, zero.state), zero)
