"""Inputs of the autoscaling policy: the policy itself (targets, bounds, windows; built from `spec.autoscaling`) and
the aggregation of each role's pod samples into the numbers the policy compares with those targets (policy.py).
Pure: no I/O."""
from __future__ import annotations

from dataclasses import dataclass, field

from disagg.operator.autoscaling import samples as m
from disagg.operator.autoscaling.samples import (PROMPT_TOKENS, PodSample, histogram_delta, histogram_quantile,
                                                 merge_histograms)


ROLES = ("prefill", "decode")

# What each role's decision can read, by signal name -> the metrics that carry it (the first one a pod exports
# counts). vLLM workers export the vllm: names but none of the disagg: gauges (pending loads they count by stage);
# pending sends and loads come then from the router's per-endpoint view (samples.attribute_handoff_signals). A
# signal no fresh pod exports is left out of the decision (never read as zero) and named in status.
SIGNALS: dict[str, dict[str, tuple[str, ...]]] = {
    "prefill": {"waitingRequests": (m.NUM_REQUESTS_WAITING,), "waitingPromptTokens": (m.WAITING_PROMPT_TOKENS,),
                "timeToFirstToken": (m.TTFT,), "pendingSends": (m.PENDING_SENDS, m.ROUTER_PENDING_SENDS),
                "promptTokensRate": (PROMPT_TOKENS,), "expiredLeases": (m.EXPIRED_LEASES,)},
    "decode": {"kvCacheUsage": (m.KV_CACHE_USAGE,), "interTokenLatency": (m.ITL,),
               "pendingLoads": (m.PENDING_LOADS, m.VLLM_PENDING_LOADS, m.ROUTER_PENDING_LOADS),
               "transferTime": (m.XFER_TIME,),
               "failedTransfers": (m.FAILED_TRANSFERS,)},
}


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
    idle_to_zero_seconds: float | None = None  # scaleToZero: both pools to 0 after this long idle (None: off)

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
        idle_to_zero_seconds=a.scale_to_zero.idle_seconds if a.scale_to_zero.enabled else None,
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
    signals_used: list[str] = field(default_factory=list)  # SIGNALS[role] some fresh pod exported
    signals_unavailable: list[str] = field(default_factory=list)  # SIGNALS[role] no fresh pod exported


def _exported(fresh: list[PodSample], names: tuple[str, ...]) -> str | None:
    """The first of `names` some pod exports (as a value or a histogram)."""
    return next((n for n in names for s in fresh if n in s.values or n in s.histograms), None)


def _required(role: str, policy: AutoscalePolicy) -> list[str]:
    if role == "prefill":
        return [m.NUM_REQUESTS_WAITING] if policy.waiting_requests_per_pod is not None else []
    return [m.KV_CACHE_USAGE] if policy.kv_cache_usage is not None else []


def is_fresh(sample: PodSample, now: float, policy: AutoscalePolicy) -> bool:
    """The pod was read, and not longer than stale_after_seconds ago: its numbers count."""
    return not sample.missing and now - sample.timestamp <= policy.stale_after_seconds


def aggregate_role(role: str, samples: list[PodSample], previous: dict[str, PodSample], now: float,
                   policy: AutoscalePolicy) -> RoleMetrics:
    """Sum gauges over pods; latencies from histogram deltas against each pod's previous sample."""
    rm = RoleMetrics(role)
    fresh = []
    for s in samples:
        if is_fresh(s, now, policy):
            fresh.append(s)
            rm.absent += [f"{s.pod}:{name}" for name in _required(role, policy) if name not in s.values]
        elif s.missing:
            rm.missing.append(f"{s.pod} ({s.error})")
        else:
            rm.stale.append(f"{s.pod} ({now - s.timestamp:.0f}s old)")
    rm.pods = len(fresh)
    v = lambda s, name: s.values.get(name, 0.0)  # noqa: E731
    rm.waiting_requests = sum(v(s, m.NUM_REQUESTS_WAITING) for s in fresh)
    rm.waiting_prompt_tokens = sum(v(s, m.WAITING_PROMPT_TOKENS) for s in fresh)
    rm.running_requests = sum(v(s, m.NUM_REQUESTS_RUNNING) for s in fresh)
    usage = [s.values[m.KV_CACHE_USAGE] for s in fresh if m.KV_CACHE_USAGE in s.values]
    rm.kv_cache_usage = sum(usage) / len(usage) if usage else None
    for signal, names in SIGNALS[role].items():
        (rm.signals_used if _exported(fresh, names) else rm.signals_unavailable).append(signal)
    sends = _exported(fresh, SIGNALS["prefill"]["pendingSends"]) or m.PENDING_SENDS
    rm.pending_sends = sum(v(s, sends) for s in fresh)
    loads = _exported(fresh, SIGNALS["decode"]["pendingLoads"]) or m.PENDING_LOADS
    rm.pending_loads = sum(v(s, loads) for s in fresh)
    served = 0.0
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
