"""Demand side of the autoscaling policy (policy.py): the replicas each role needs - projected one start-up delay
ahead (`project`) and proportional to its metrics against the targets, gated by which pool is the bottleneck
(`classify`). Pure: no I/O."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from disagg.operator.autoscaling.inputs import AutoscalePolicy, RoleMetrics


@dataclass(frozen=True)
class RoleLevels:
    """A role's levels at one decision: the next decision's growth rates come from them."""

    time: float  # seconds, the injected clock
    waiting_prompt_tokens: float  # sum over pods
    kv_cache_usage: float | None  # mean over pods, fraction
    prefill_tokens_per_pod_second: float | None  # last measured while every pod was busy (queue at both ends)



# ---------------------------------------------------------------- projection: demand one start-up delay ahead
def project(rms: dict[str, RoleMetrics], current: dict[str, int], policy: AutoscalePolicy,
            previous: dict[str, RoleLevels], now: float) -> tuple[dict[str, tuple[float, bool]], dict[str, RoleLevels]]:
    """Replicas each role will need when a pod ordered now serves (policy.scale_up_lookahead_seconds), from the
    growth since the previous decision. Returns role -> (pods, whether they also floor a scale-down), and the
    levels to remember. Decode only when above current (outside the tolerance).

    prefill: arrival = served prompt tokens/s (vllm:prompt_tokens) + the queue's growth; pods needed = arrival /
    per-pod throughput (measured while every pod was busy) + the queue projected one lookahead ahead, drained over
    the next lookahead. decode: KV usage projected one lookahead ahead (concurrency grows with requests' length)."""
    p, d, horizon, tol = rms["prefill"], rms["decode"], policy.scale_up_lookahead_seconds, policy.tolerance
    prev_p, prev_d = previous.get("prefill"), previous.get("decode")
    per_pod = prev_p.prefill_tokens_per_pod_second if prev_p else None
    pulled = p.pending_sends <= policy.pending_sends_per_pod * max(1, p.pods)  # else idle behind unsent KV
    if (prev_p and prev_p.waiting_prompt_tokens > 0 and p.waiting_prompt_tokens > 0 and p.prompt_tokens_rate
            and p.rate_pods and pulled):
        per_pod = p.prompt_tokens_rate / p.rate_pods  # busy the whole window: this is what a pod can do
    levels = {"prefill": RoleLevels(now, p.waiting_prompt_tokens, p.kv_cache_usage, per_pod),
              "decode": RoleLevels(now, d.waiting_prompt_tokens, d.kv_cache_usage, None)}
    out: dict[str, tuple[float, bool]] = {}
    if horizon <= 0:
        return out, levels
    cd = current.get("decode", 0)
    if prev_p and now > prev_p.time and p.prompt_tokens_rate is not None:
        growth = (p.waiting_prompt_tokens - prev_p.waiting_prompt_tokens) / (now - prev_p.time)  # tokens/s
        # a pod's throughput not measured yet: what it served is a lower bound (an upper bound on the pods needed,
        # so it only scales up while the queue grows, never sets a floor)
        mu = per_pod or (p.prompt_tokens_rate / p.rate_pods if p.rate_pods else 0.0)
        if mu > 0 and (per_pod or growth > 0):
            queue = p.waiting_prompt_tokens + max(0.0, growth) * horizon
            busy = policy.prefill_utilization if per_pod else 1.0
            need = (p.prompt_tokens_rate + growth) / (mu * busy) + queue / (mu * horizon)
            out["prefill"] = (need, per_pod is not None)
    if (prev_d and now > prev_d.time and policy.kv_cache_usage and d.kv_cache_usage is not None
            and prev_d.kv_cache_usage is not None):
        growth = max(0.0, (d.kv_cache_usage - prev_d.kv_cache_usage) / (now - prev_d.time))  # fraction/s
        usage = d.kv_cache_usage + growth * horizon
        need = d.pods * usage / policy.kv_cache_usage
        if need > cd * (1 + tol):
            out["decode"] = (need, False)
    return out, levels


# ---------------------------------------------------------------- classification: who may scale, and why
# the signals (inputs.SIGNALS names) behind each role's target ratios, in classify's order, and behind its projection
PREFILL_TARGET_SIGNALS = ("waitingRequests", "waitingPromptTokens", "timeToFirstToken")
DECODE_TARGET_SIGNALS = ("kvCacheUsage", "interTokenLatency")
PROJECTED_SIGNAL = {"prefill": "promptTokensRate", "decode": "kvCacheUsage"}


@dataclass
class Classification:
    bottleneck: str | None
    recommendation: dict[str, int]  # role -> proportional recommendation after bottleneck gating
    reasons: dict[str, str]  # role -> reason for it
    metrics: dict[str, float | None]
    transfer_message: str = ""
    # role -> the signals (inputs.SIGNALS names) whose recommendation this role's is, or that held it back
    decided_by: dict[str, list[str]] = field(default_factory=dict)


def _desired_for(current: int, ratio: float | None, tolerance: float, ready: int | None = None) -> int | None:
    """HPA: ceil(current x value/target), or current inside the tolerance. `ratio` = value/target.
    `ready`: pods the value was measured on, when fewer than `current` (the others are starting). As HPA does for
    unready pods, the value is then scaled from the ready pods only, and the starting pods count as capacity on
    the way: no scale-up they already cover (a latency stays high until they serve), and no scale-down while
    they start."""
    if ratio is None:
        return None
    if abs(ratio - 1.0) <= tolerance:
        return current
    if ready is not None and ready < current:
        return max(current, math.ceil(ready * ratio - 1e-9))
    return math.ceil(current * ratio - 1e-9)


def _sum_ratio(total: float, target: float | None, current: int) -> float | None:
    """value/target for a per-pod average of a summed metric (queues): total / (target x pods)."""
    if target is None:
        return None
    return total / (target * current) if current > 0 else (math.inf if total > 0 else 0.0)


def _div(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a / b


def classify(rms: dict[str, RoleMetrics], current: dict[str, int], policy: AutoscalePolicy,
             projected: dict[str, tuple[float, bool]] | None = None) -> Classification:
    """`projected`: scale-up recommendations from project(), gated like the current metrics' ones."""
    p, d = rms["prefill"], rms["decode"]
    cp, cd, tol = current.get("prefill", 0), current.get("decode", 0), policy.tolerance
    p_ratios = [_sum_ratio(p.waiting_requests, policy.waiting_requests_per_pod, cp),
                _sum_ratio(p.waiting_prompt_tokens, policy.waiting_prompt_tokens_per_pod, cp),
                _div(p.ttft, policy.ttft_seconds)]
    d_ratios = [_div(d.kv_cache_usage, policy.kv_cache_usage), _div(d.itl, policy.itl_seconds)]
    xfer_time = d.xfer_time if d.xfer_time is not None else p.xfer_time
    sends_ratio = _sum_ratio(p.pending_sends, policy.pending_sends_per_pod, cp) or 0.0
    loads_ratio = _sum_ratio(d.pending_loads, policy.pending_loads_per_pod, cd)
    xfer_ratio = _div(xfer_time, policy.xfer_time_seconds)
    failed, expired = p.failed_transfers + d.failed_transfers, p.expired_leases + d.expired_leases

    # start-up aware (a lookahead set): every per-pod value is judged on the pods serving (fresh samples come from
    # ready pods only); starting pods are capacity on the way
    aware = policy.scale_up_lookahead_seconds > 0
    p_recs = [_desired_for(cp, r, tol, p.pods if aware else None) for r in p_ratios]
    d_recs = [_desired_for(cd, r, tol, d.pods if aware else None) for r in d_ratios]
    # role -> signal -> the replicas it asks for (the role's recommendation is the largest)
    asks = {"prefill": {n: x for n, x in zip(PREFILL_TARGET_SIGNALS, p_recs) if x is not None},
            "decode": {n: x for n, x in zip(DECODE_TARGET_SIGNALS, d_recs) if x is not None}}
    rec = {"prefill": max(asks["prefill"].values(), default=cp), "decode": max(asks["decode"].values(), default=cd)}
    for role, (need, floor) in (projected or {}).items():
        c, n = current.get(role, 0), math.ceil(need - 1e-9)
        if need > c * (1 + tol):
            rec[role] = asks[role][PROJECTED_SIGNAL[role]] = max(rec[role], n)
        elif floor and rec[role] < c:  # a latency under target says little about how many pods the load needs
            rec[role] = asks[role][PROJECTED_SIGNAL[role]] = max(rec[role], min(c, n))
    p_over, d_over = rec["prefill"] > cp, rec["decode"] > cd
    backlog = sends_ratio > 1 + tol or expired > 0  # KV waits at prefill to be pulled
    slow: list[str] = []
    if xfer_ratio is not None and xfer_ratio > 1 + tol:
        slow.append(f"transfer time {xfer_time:.3f}s over target {policy.xfer_time_seconds:.3f}s")
    if loads_ratio is not None and loads_ratio > 1 + tol:
        slow.append(f"{d.pending_loads:.0f} pending loads over {policy.pending_loads_per_pod} per pod x {cd}")
    if failed > 0:
        slow.append(f"{failed:.0f} failed transfers")

    blocked: dict[str, str] = {}  # role -> why it does not scale up
    held_by: list[str] = []  # the signals that blocked it
    # decode's KV also holds requests whose KV is still in flight, so with slow transfers only ITL says decode is
    # short of compute
    itl_over = d.itl is not None and policy.itl_seconds is not None and d.itl / policy.itl_seconds > 1 + tol
    if slow and not itl_over and (not p_over or backlog):
        bottleneck = "TransferBound"
        rec = {"prefill": cp, "decode": cd}  # hold: more pods add no fabric bandwidth
        blocked = {"prefill": bottleneck, "decode": bottleneck}
        held_by = [n for n, over in (("transferTime", xfer_ratio is not None and xfer_ratio > 1 + tol),
                                     ("pendingLoads", loads_ratio is not None and loads_ratio > 1 + tol),
                                     ("failedTransfers", failed > 0)) if over]
    elif d_over or (backlog and not slow):
        bottleneck = "PrefillAndDecodeBound" if p_over and not backlog else "DecodeBound"
        if backlog:
            held_by = [n for n, over in (("pendingSends", sends_ratio > 1 + tol), ("expiredLeases", expired > 0))
                       if over]
            rec["decode"] = max(rec["decode"], _desired_for(cd, max(sends_ratio, 1 + 2 * tol), tol) or 1)
            asks["decode"].update(dict.fromkeys(held_by, rec["decode"]))
            if p_over:  # prefill's queue is decode's back-pressure: never scale prefill up for it
                rec["prefill"], blocked["prefill"] = cp, bottleneck
    elif p_over:
        bottleneck = "PrefillBound"
    else:
        bottleneck = None
    reasons, decided_by = {}, {}
    for role, c in (("prefill", cp), ("decode", cd)):
        decided_by[role] = (held_by if role in blocked else
                            [n for n, x in asks[role].items() if x == rec[role]] if rec[role] != c else [])
        if rec[role] > c:
            reasons[role] = bottleneck if bottleneck != "PrefillAndDecodeBound" else (
                "PrefillBound" if role == "prefill" else "DecodeBound")
        elif rec[role] < c:
            reasons[role] = "Underutilized"
        else:
            reasons[role] = blocked.get(role, "WithinTolerance")
    def per(rm: RoleMetrics, total: float, signal: str | None = None) -> float | None:
        """Per pod; None (not measured, so not told) when no pod exports the signal."""
        return None if not rm.pods or signal in rm.signals_unavailable else total / rm.pods

    metrics = {
        "prefill_waiting_requests_per_pod": per(p, p.waiting_requests, "waitingRequests"),
        "prefill_waiting_prompt_tokens_per_pod": per(p, p.waiting_prompt_tokens, "waitingPromptTokens"),
        "prefill_ttft_seconds": p.ttft,
        "prefill_pending_sends_per_pod": per(p, p.pending_sends, "pendingSends"),
        "decode_kv_cache_usage": d.kv_cache_usage,
        "decode_itl_seconds": d.itl,
        "decode_running_requests_per_pod": per(d, d.running_requests),
        "decode_pending_loads_per_pod": per(d, d.pending_loads, "pendingLoads"),
        "xfer_time_seconds": xfer_time,
        "failed_transfers": failed,
        "expired_leases": expired,
    }
    return Classification(bottleneck, rec, reasons, metrics, "; ".join(slow), decided_by)
