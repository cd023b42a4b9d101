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

from disagg.operator import metrics_source as m
from disagg.operator.metrics_source import PodSample, histogram_delta, histogram_quantile, merge_histograms

ROLES = ("prefill", "decode")
PROMPT_TOKENS = "vllm:prompt_tokens"  # counter: prompt tokens a worker has prefilled


# ---------------------------------------------------------------- policy
@dataclass(frozen=True)
class RoleBounds:
    min_replicas: int = 1
    max_replicas: int = 4


@dataclass(frozen=True)
class AutoscalePolicy:
    prefill: RoleBounds = RoleBounds()
    decode: RoleBounds = RoleBounds()
    waiting_requests_per_pod: float | None = 4.0  # prefill: vllm:num_requests_waiting per pod
    waiting_prompt_tokens_per_pod: float | None = None  # prefill: disagg:num_waiting_prompt_tokens per pod
    ttft_seconds: float | None = None  # prefill pods' TTFT at latency_quantile
    kv_cache_usage: float | None = 0.8  # decode: vllm:kv_cache_usage_perc (fraction), mean over pods
    itl_seconds: float | None = None  # decode pods' ITL at latency_quantile
    xfer_time_seconds: float | None = None  # vllm:nixl_xfer_time_seconds at latency_quantile
    pending_loads_per_pod: float | None = None  # decode: disagg:kv_pending_loads per pod (a transfer signal)
    pending_sends_per_pod: float = 2.0  # prefill: disagg:kv_pending_sends per pod above this = KV back-pressure
    tolerance: float = 0.1  # no change while |value/target - 1| <= tolerance
    scale_up_window_seconds: float = 0.0
    scale_down_window_seconds: float = 300.0
    max_step: int = 1  # most replicas added or removed per role per decision
    ratio_min: tuple[int, int] | None = None  # (prefill, decode): prefill/decode >= p/d
    ratio_max: tuple[int, int] | None = None
    stale_after_seconds: float = 45.0  # a sample older than this is stale
    latency_quantile: float | None = 0.9  # None: windowed mean
    # Start-up aware scaling (0: off): seconds from ordering a pod to its serving. Starting pods then count as
    # capacity on the way, and the queue's and KV usage's growth is projected this far ahead for scale-up (only:
    # scale-down stays on current load).
    scale_up_lookahead_seconds: float = 0.0
    max_step_percent: float | None = None  # scale-up step also allowed up to this % of current (HPA: 100 per 15 s)
    prefill_utilization: float = 1.0  # with a lookahead: the prefill pods' busy fraction to size for (0..1]

    def bounds(self, role: str) -> RoleBounds:
        return self.prefill if role == "prefill" else self.decode


def policy_from_spec(spec_autoscaling) -> AutoscalePolicy:
    """Build the policy from `spec.autoscaling` (disagg.operator.spec.AutoscalingSpec)."""
    a = spec_autoscaling
    t = a.targets
    ms = lambda v: None if v is None else v / 1000.0  # noqa: E731  milliseconds -> seconds
    ratio = lambda r: None if r is None else (r.prefill, r.decode)  # noqa: E731
    return AutoscalePolicy(
        prefill=RoleBounds(a.prefill.min_replicas, a.prefill.max_replicas),
        decode=RoleBounds(a.decode.min_replicas, a.decode.max_replicas),
        waiting_requests_per_pod=t.prefill.waiting_requests_per_pod,
        waiting_prompt_tokens_per_pod=t.prefill.waiting_prompt_tokens_per_pod,
        ttft_seconds=ms(t.prefill.time_to_first_token_milliseconds),
        kv_cache_usage=None if t.decode.kv_cache_usage_percent is None else t.decode.kv_cache_usage_percent / 100,
        itl_seconds=ms(t.decode.inter_token_latency_milliseconds),
        xfer_time_seconds=ms(t.transfer.kv_transfer_time_milliseconds),
        pending_loads_per_pod=t.transfer.pending_loads_per_pod,
        pending_sends_per_pod=t.transfer.pending_sends_per_pod,
        tolerance=a.tolerance_percent / 100,
        scale_up_window_seconds=a.stabilization.scale_up_seconds,
        scale_down_window_seconds=a.stabilization.scale_down_seconds,
        max_step=a.max_step_per_interval,
        ratio_min=ratio(a.prefill_decode_ratio.min),
        ratio_max=ratio(a.prefill_decode_ratio.max),
        stale_after_seconds=(a.stale_after_seconds if a.stale_after_seconds is not None
                             else 3 * a.interval_seconds + a.metrics_source.timeout_seconds),
        latency_quantile=a.latency_percentile / 100 if a.latency_statistic == "Percentile" else None,
        scale_up_lookahead_seconds=a.stabilization.scale_up_lookahead_seconds,
        max_step_percent=a.max_step_percent_per_interval,
        prefill_utilization=t.prefill.utilization_percent / 100,
    )


# ---------------------------------------------------------------- aggregation
@dataclass
class RoleMetrics:
    """One role's pods folded into the numbers the policy compares with targets."""

    role: str
    pods: int = 0  # fresh samples used
    missing: list[str] = field(default_factory=list)  # pods whose read failed
    stale: list[str] = field(default_factory=list)  # pods whose sample is older than stale_after_seconds
    absent: list[str] = field(default_factory=list)  # "pod:metric" a target needs but the pod did not export
    waiting_requests: float = 0.0  # sum over pods
    waiting_prompt_tokens: float = 0.0  # sum over pods
    running_requests: float = 0.0  # sum over pods
    kv_cache_usage: float | None = None  # mean over pods, fraction
    pending_sends: float = 0.0  # sum over pods
    pending_loads: float = 0.0  # sum over pods
    ttft: float | None = None  # seconds, over the window since the previous samples; None: no observations
    itl: float | None = None  # seconds, same window
    xfer_time: float | None = None  # seconds, same window
    failed_transfers: float = 0.0  # in the window
    expired_leases: float = 0.0  # in the window
    prompt_tokens_rate: float | None = None  # prompt tokens/s served in the window (vllm:prompt_tokens), all pods
    rate_pods: int = 0  # pods that rate was measured on (those with a previous sample)


def _required(role: str, policy: AutoscalePolicy) -> list[str]:
    if role == "prefill":
        return [m.NUM_REQUESTS_WAITING] if policy.waiting_requests_per_pod is not None else []
    return [m.KV_CACHE_USAGE] if policy.kv_cache_usage is not None else []


def aggregate_role(role: str, samples: list[PodSample], previous: dict[str, PodSample], now: float,
                   policy: AutoscalePolicy) -> RoleMetrics:
    """Sum gauges over pods; latencies from histogram deltas against each pod's previous sample."""
    rm = RoleMetrics(role)
    fresh = []
    for s in samples:
        if s.missing:
            rm.missing.append(f"{s.pod} ({s.error})")
        elif now - s.timestamp > policy.stale_after_seconds:
            rm.stale.append(f"{s.pod} ({now - s.timestamp:.0f}s old)")
        else:
            fresh.append(s)
            rm.absent += [f"{s.pod}:{name}" for name in _required(role, policy) if name not in s.values]
    rm.pods = len(fresh)
    v = lambda s, name: s.values.get(name, 0.0)  # noqa: E731
    rm.waiting_requests = sum(v(s, m.NUM_REQUESTS_WAITING) for s in fresh)
    rm.waiting_prompt_tokens = sum(v(s, m.WAITING_PROMPT_TOKENS) for s in fresh)
    rm.running_requests = sum(v(s, m.NUM_REQUESTS_RUNNING) for s in fresh)
    usage = [s.values[m.KV_CACHE_USAGE] for s in fresh if m.KV_CACHE_USAGE in s.values]
    rm.kv_cache_usage = sum(usage) / len(usage) if usage else None
    rm.pending_sends = sum(v(s, m.PENDING_SENDS) for s in fresh)
    rm.pending_loads = sum(v(s, m.PENDING_LOADS) for s in fresh)
    served, seconds = 0.0, []
    for s in fresh:
        prev = previous.get(s.pod)
        if (prev is not None and PROMPT_TOKENS in s.values and PROMPT_TOKENS in prev.values
                and s.timestamp > prev.timestamp):
            served += max(0.0, s.values[PROMPT_TOKENS] - prev.values[PROMPT_TOKENS]) / (s.timestamp - prev.timestamp)
            rm.rate_pods += 1
        if prev is not None:
            rm.failed_transfers += max(0.0, v(s, m.FAILED_TRANSFERS) - v(prev, m.FAILED_TRANSFERS))
            rm.expired_leases += max(0.0, v(s, m.EXPIRED_LEASES) - v(prev, m.EXPIRED_LEASES))
    rm.prompt_tokens_rate = served if rm.rate_pods else None
    rm.ttft = _window_latency(m.TTFT, fresh, previous, policy.latency_quantile)
    rm.itl = _window_latency(m.ITL, fresh, previous, policy.latency_quantile)
    rm.xfer_time = _window_latency(m.XFER_TIME, fresh, previous, policy.latency_quantile)
    return rm


def _window_latency(name: str, fresh: list[PodSample], previous: dict[str, PodSample],
                    q: float | None) -> float | None:
    deltas = []
    for s in fresh:
        prev = previous.get(s.pod)
        if name in s.histograms and prev is not None:
            d = histogram_delta(s.histograms[name], prev.histograms.get(name))
            if d is not None and d.count > 0:
                deltas.append(d)
    window = merge_histograms(deltas)
    if window is None:
        return None
    return window.mean if q is None else histogram_quantile(q, window)


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


@dataclass(frozen=True)
class RoleLevels:
    """A role's levels at one decision: the next decision's growth rates come from them."""

    time: float  # seconds, the injected clock
    waiting_prompt_tokens: float  # sum over pods
    kv_cache_usage: float | None  # mean over pods, fraction
    prefill_tokens_per_pod_second: float | None  # last measured while every pod was busy (queue at both ends)


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

    @property
    def desired(self) -> dict[str, int]:
        return {r: d.desired for r, d in self.roles.items()}


def decide(samples_by_role: dict[str, list[PodSample]], current_replicas: dict[str, int], policy: AutoscalePolicy,
           history: ScalingHistory, now: float) -> Decision:
    """One autoscaling decision for both pools."""
    previous = history.last_samples
    rms = {r: aggregate_role(r, samples_by_role.get(r, []), previous, now, policy) for r in ROLES}
    last = dict(previous)
    for r in ROLES:
        for s in samples_by_role.get(r, []):
            if not s.missing and now - s.timestamp <= policy.stale_after_seconds:
                last[s.pod] = s
    history = replace(history, last_samples=last)
    bad = _metrics_problem(rms, current_replicas)
    if bad is not None:
        return hold_decision(bad[0], bad[1], rms, current_replicas, policy, history, now)
    projected, levels = project(rms, current_replicas, policy, history.levels, now)
    history = replace(history, levels=levels)
    return scale_decision(classify(rms, current_replicas, policy, projected), rms, current_replicas, policy, history,
                          now)


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
    cp, cd = current.get("prefill", 0), current.get("decode", 0)
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
@dataclass
class Classification:
    bottleneck: str | None
    recommendation: dict[str, int]  # role -> proportional recommendation after bottleneck gating
    reasons: dict[str, str]  # role -> reason for it
    metrics: dict[str, float | None]
    transfer_message: str = ""


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
    rec = {"prefill": max([x for x in p_recs if x is not None], default=cp),
           "decode": max([x for x in d_recs if x is not None], default=cd)}
    for role, (need, floor) in (projected or {}).items():
        c, n = current.get(role, 0), math.ceil(need - 1e-9)
        if need > c * (1 + tol):
            rec[role] = max(rec[role], n)
        elif floor and rec[role] < c:  # a latency under target says little about how many pods the load needs
            rec[role] = max(rec[role], min(c, n))
    p_over, d_over = rec["prefill"] > cp, rec["decode"] > cd
    backlog = sends_ratio > 1 + tol or expired > 0  # KV waits at prefill to be pulled
    slow = [f"transfer time {xfer_time:.3f}s over target {policy.xfer_time_seconds:.3f}s"
            for _ in [0] if xfer_ratio is not None and xfer_ratio > 1 + tol]
    slow += [f"{d.pending_loads:.0f} pending loads over {policy.pending_loads_per_pod} per pod x {cd}"
             for _ in [0] if loads_ratio is not None and loads_ratio > 1 + tol]
    slow += [f"{failed:.0f} failed transfers"] if failed > 0 else []

    blocked: dict[str, str] = {}  # role -> why it does not scale up
    # decode's KV also holds requests whose KV is still in flight, so with slow transfers only ITL says decode is
    # short of compute
    itl_over = d.itl is not None and policy.itl_seconds is not None and d.itl / policy.itl_seconds > 1 + tol
    if slow and not itl_over and (not p_over or backlog):
        bottleneck = "TransferBound"
        rec = {"prefill": cp, "decode": cd}  # hold: more pods add no fabric bandwidth
        blocked = {"prefill": bottleneck, "decode": bottleneck}
    elif d_over or (backlog and not slow):
        bottleneck = "PrefillAndDecodeBound" if p_over and not backlog else "DecodeBound"
        if backlog:
            rec["decode"] = max(rec["decode"], _desired_for(cd, max(sends_ratio, 1 + 2 * tol), tol) or 1)
            if p_over:  # prefill's queue is decode's back-pressure: never scale prefill up for it
                rec["prefill"], blocked["prefill"] = cp, bottleneck
    elif p_over:
        bottleneck = "PrefillBound"
    else:
        bottleneck = None
    reasons = {}
    for role, c in (("prefill", cp), ("decode", cd)):
        if rec[role] > c:
            reasons[role] = bottleneck if bottleneck != "PrefillAndDecodeBound" else (
                "PrefillBound" if role == "prefill" else "DecodeBound")
        elif rec[role] < c:
            reasons[role] = "Underutilized"
        else:
            reasons[role] = blocked.get(role, "WithinTolerance")
    per = lambda total, n: total / n if n else None  # noqa: E731
    metrics = {
        "prefill_waiting_requests_per_pod": per(p.waiting_requests, p.pods),
        "prefill_waiting_prompt_tokens_per_pod": per(p.waiting_prompt_tokens, p.pods),
        "prefill_ttft_seconds": p.ttft,
        "prefill_pending_sends_per_pod": per(p.pending_sends, p.pods),
        "decode_kv_cache_usage": d.kv_cache_usage,
        "decode_itl_seconds": d.itl,
        "decode_running_requests_per_pod": per(d.running_requests, d.pods),
        "decode_pending_loads_per_pod": per(d.pending_loads, d.pods),
        "xfer_time_seconds": xfer_time,
        "failed_transfers": failed,
        "expired_leases": expired,
    }
    return Classification(bottleneck, rec, reasons, metrics, "; ".join(slow))


# ---------------------------------------------------------------- stabilization, limits, bounds
def _stabilize(role: str, rec: int, current: int, policy: AutoscalePolicy, history: ScalingHistory,
               now: float) -> tuple[int, list[Recommendation]]:
    """HPA: scale up to the lowest recommendation of the up window, down to the highest of the down window."""
    keep = max(policy.scale_up_window_seconds, policy.scale_down_window_seconds)
    recs = [r for r in history.recommendations.get(role, []) if now - r.time <= keep]
    recs.append(Recommendation(now, rec))
    up = min(r.replicas for r in recs if now - r.time <= policy.scale_up_window_seconds)
    down = max(r.replicas for r in recs if now - r.time <= policy.scale_down_window_seconds)
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
                    _conditions(None, c, roles), history)


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
        active = ScalingCondition("ScalingActive", "True", "ValidMetrics",
                                  f"bottleneck: {c.bottleneck}" if c.bottleneck else "no bottleneck")
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
