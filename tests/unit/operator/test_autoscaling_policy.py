"""Autoscaling policy, table-driven: bottleneck classes, tolerance, windows, step limits, min/max, ratio bounds,
stale and missing metrics. The clock is the `now` argument; history goes in and comes back."""
from __future__ import annotations

import math
from dataclasses import replace

import pytest

from disagg.operator.autoscaling import samples as m
from disagg.operator.autoscaling.classify import RoleLevels
from disagg.operator.autoscaling.inputs import AutoscalePolicy, RoleBounds, aggregate_role, policy_from_spec
from disagg.operator.autoscaling.policy import ScalingHistory, decide
from disagg.operator.autoscaling.samples import PROMPT_TOKENS, Histogram, PodSample
from disagg.operator.spec import AutoscalingSpec

BOUNDS = (0.01, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, math.inf)
NOW = 1000.0
INTERVAL = 15.0

POLICY = AutoscalePolicy(
    prefill=RoleBounds(1, 10), decode=RoleBounds(1, 10), waiting_requests_per_pod=4, kv_cache_usage=0.8,
    ttft_seconds=1.0, itl_seconds=0.05, xfer_time_seconds=0.1, pending_sends_per_pod=2, tolerance=0.1,
    scale_up_window_seconds=0, scale_down_window_seconds=0, max_step=10, latency_quantile=None,
)


def hist(value: float | None, count: float) -> Histogram:
    """`count` observations of `value` (cumulative buckets over BOUNDS)."""
    if value is None or count == 0:
        return Histogram(tuple((b, 0.0) for b in BOUNDS), 0.0, 0.0)
    return Histogram(tuple((b, count if value <= b else 0.0) for b in BOUNDS), value * count, count)


def pod_sample(role: str, i: int, t: float, n: int, load: dict, obs: float) -> PodSample:
    """Pod i of n: totals in `load` split evenly; latencies as `obs` observations each."""
    names = {"waiting": m.NUM_REQUESTS_WAITING, "sends": m.PENDING_SENDS, "loads": m.PENDING_LOADS,
             "kv": m.KV_CACHE_USAGE, "failed": m.FAILED_TRANSFERS, "expired": m.EXPIRED_LEASES}
    values = {names[k]: (v if k == "kv" else v / n) * (1 if k not in ("failed", "expired") or obs else 0)
              for k, v in load.items() if k in names}
    values.setdefault(m.NUM_REQUESTS_WAITING, 0.0)
    if role == "decode":
        values.setdefault(m.KV_CACHE_USAGE, 0.5)
    hists = {name: hist(load.get(k), obs) for k, name in (("ttft", m.TTFT), ("itl", m.ITL), ("xfer", m.XFER_TIME))}
    return PodSample(f"{role}-{i}", role, t, values, hists)


def world(prefill: dict, decode: dict, n_p: int = 2, n_d: int = 2, t: float = NOW):
    """Samples now, and a history holding each pod's previous read one interval ago (no observations yet)."""
    samples = {"prefill": [pod_sample("prefill", i, t, n_p, prefill, 10) for i in range(n_p)],
               "decode": [pod_sample("decode", i, t, n_d, decode, 10) for i in range(n_d)]}
    prev = [pod_sample(r, i, t - INTERVAL, n, {}, 0) for r, n in (("prefill", n_p), ("decode", n_d))
            for i in range(n)]
    return samples, ScalingHistory(last_samples={s.pod: s for s in prev})


IDLE = {"waiting": 0}
BUSY_DECODE = {"kv": 0.8}

# name, prefill load, decode load, policy overrides -> (prefill, decode), bottleneck, reason, TransferBound status
CASES = [
    ("at target", {"waiting": 8}, BUSY_DECODE, {}, (2, 2), None, "WithinTolerance", "False"),
    ("inside tolerance (+7.5%)", {"waiting": 8.6}, {"kv": 0.86}, {}, (2, 2), None, "WithinTolerance", "False"),
    ("outside tolerance (+15%)", {"waiting": 9.2}, BUSY_DECODE, {}, (3, 2), "PrefillBound", "PrefillBound", "False"),
    ("zero tolerance", {"waiting": 8.6}, BUSY_DECODE, {"tolerance": 0}, (3, 2), "PrefillBound", "PrefillBound",
     "False"),
    ("prefill queue", {"waiting": 20}, BUSY_DECODE, {}, (5, 2), "PrefillBound", "PrefillBound", "False"),
    ("prefill TTFT", {"waiting": 8, "ttft": 2.0}, BUSY_DECODE, {}, (4, 2), "PrefillBound", "PrefillBound", "False"),
    ("decode KV usage", {"waiting": 8}, {"kv": 0.96}, {}, (2, 3), "DecodeBound", "DecodeBound", "False"),
    ("decode ITL", {"waiting": 8}, {"kv": 0.8, "itl": 0.1}, {}, (2, 4), "DecodeBound", "DecodeBound", "False"),
    # the known complaint: decode is not pulling, prefill's queue grows behind its unsent KV -> scale decode only
    ("KV waits to be pulled", {"waiting": 20, "sends": 12}, {"kv": 0.7}, {}, (2, 6), "DecodeBound", "DecodeBound",
     "False"),
    ("decode over + back-pressure", {"waiting": 20, "sends": 12}, {"kv": 0.96}, {}, (2, 6), "DecodeBound",
     "DecodeBound", "False"),
    ("expired leases", {"waiting": 8, "expired": 3}, BUSY_DECODE, {}, (2, 3), "DecodeBound", "DecodeBound", "False"),
    ("both pools over, KV pulled", {"waiting": 20}, {"kv": 0.96}, {}, (5, 3), "PrefillAndDecodeBound",
     "PrefillAndDecodeBound", "False"),
    ("transfer slow, pools fine", {"waiting": 8}, {"kv": 0.8, "xfer": 0.5}, {}, (2, 2), "TransferBound",
     "TransferBound", "True"),
    ("transfer slow, KV backs up", {"waiting": 20, "sends": 12}, {"kv": 0.7, "xfer": 0.5}, {}, (2, 2),
     "TransferBound", "TransferBound", "True"),
    ("pending loads over target", {"waiting": 8}, {"kv": 0.8, "loads": 10}, {"pending_loads_per_pod": 2}, (2, 2),
     "TransferBound", "TransferBound", "True"),
    ("failed transfers", {"waiting": 8}, {"kv": 0.8, "failed": 2}, {}, (2, 2), "TransferBound", "TransferBound",
     "True"),
    ("transfer slow, prefill itself slow", {"waiting": 20}, {"kv": 0.8, "xfer": 0.5}, {}, (5, 2), "PrefillBound",
     "PrefillBound", "False"),
    # decode's KV fills with requests whose KV is in flight: not a decode shortage
    ("transfer slow, decode KV full", {"waiting": 8}, {"kv": 0.96, "xfer": 0.5}, {}, (2, 2), "TransferBound",
     "TransferBound", "True"),
    ("transfer slow, decode ITL over", {"waiting": 8}, {"kv": 0.8, "itl": 0.1, "xfer": 0.5}, {}, (2, 4),
     "DecodeBound", "DecodeBound", "False"),
    ("underutilized", IDLE, {"kv": 0.2}, {}, (1, 1), None, "Underutilized", "False"),
    ("no targets but queue", {"waiting": 20}, {"kv": 0.96},
     {"waiting_requests_per_pod": None, "kv_cache_usage": None}, (2, 2), None, "WithinTolerance", "False"),
]


@pytest.mark.parametrize("name, prefill, decode, overrides, desired, bottleneck, reason, transfer_bound", CASES,
                         ids=[c[0] for c in CASES])
def test_bottleneck_classes(name, prefill, decode, overrides, desired, bottleneck, reason, transfer_bound):
    samples, history = world(prefill, decode)
    d = decide(samples, {"prefill": 2, "decode": 2}, replace(POLICY, **overrides), history, NOW)
    assert (d.desired["prefill"], d.desired["decode"]) == desired
    assert (d.bottleneck, d.reason) == (bottleneck, reason)
    cond = {c.type: c for c in d.conditions}
    assert cond["TransferBound"].status == transfer_bound
    assert cond["ScalingActive"].status == "True"
    if bottleneck in ("DecodeBound", "TransferBound"):
        assert d.desired["prefill"] <= 2, "prefill never scales up for a decode or transfer bottleneck"


def test_decision_reports_metrics_used_and_remembers_samples():
    samples, history = world({"waiting": 20, "sends": 2, "ttft": 0.5}, {"kv": 0.6, "itl": 0.02, "xfer": 0.05})
    d = decide(samples, {"prefill": 2, "decode": 2}, POLICY, history, NOW)
    assert d.metrics["prefill_waiting_requests_per_pod"] == 10
    assert d.metrics["prefill_ttft_seconds"] == pytest.approx(0.5)
    assert d.metrics["decode_kv_cache_usage"] == 0.6
    assert d.metrics["decode_itl_seconds"] == pytest.approx(0.02)
    assert d.metrics["xfer_time_seconds"] == pytest.approx(0.05)
    assert d.roles["prefill"].recommendation == 5
    assert {s.timestamp for s in d.history.last_samples.values()} == {NOW}


def test_latency_is_windowed_between_scrapes():
    """A pod that was slow long ago but fast now: only the observations since the previous read count."""
    samples, history = world({"waiting": 8}, BUSY_DECODE)
    for s in samples["prefill"]:
        old = history.last_samples[s.pod]
        old.histograms[m.TTFT] = hist(5.0, 100)  # 100 slow first tokens before the previous read
        s.histograms[m.TTFT] = Histogram(tuple((b, c + (10 if 0.5 <= b else 0))
                                               for b, c in old.histograms[m.TTFT].buckets), 500 + 5.0, 110)
    rm = aggregate_role("prefill", samples["prefill"], history.last_samples, NOW, POLICY)
    assert rm.ttft == pytest.approx(0.5)
    assert decide(samples, {"prefill": 2, "decode": 2}, POLICY, history, NOW).desired["prefill"] == 2


def test_latency_quantile_from_buckets():
    samples, history = world({"waiting": 8, "ttft": 1.5}, BUSY_DECODE)
    rm = aggregate_role("prefill", samples["prefill"], history.last_samples, NOW, replace(POLICY, latency_quantile=0.9))
    assert rm.ttft == pytest.approx(1.0 + (2.0 - 1.0) * 0.9)  # interpolated inside the (1, 2] bucket


def test_first_read_has_no_latency():
    samples, _ = world({"waiting": 8, "ttft": 3.0}, BUSY_DECODE)
    d = decide(samples, {"prefill": 2, "decode": 2}, POLICY, ScalingHistory(), NOW)
    assert d.metrics["prefill_ttft_seconds"] is None and d.reason == "WithinTolerance"


# ---------------------------------------------------------------- stale and missing metrics
def _stale(samples):
    samples["decode"][0] = replace(samples["decode"][0], timestamp=NOW - 100)
    return samples


def _failed(samples):
    samples["prefill"][1] = PodSample("prefill-1", "prefill", NOW, error="ConnectTimeout: timed out")
    return samples


def _no_decode(samples):
    samples["decode"] = []
    return samples


def _absent_metric(samples):
    del samples["decode"][1].values[m.KV_CACHE_USAGE]
    return samples


@pytest.mark.parametrize("name, damage, reason, in_message", [
    ("stale sample", _stale, "MetricsStale", "decode-0"),
    ("scrape failed", _failed, "MetricsMissing", "ConnectTimeout"),
    ("no samples for a role", _no_decode, "MetricsMissing", "no samples for 2 replicas"),
    ("target metric not exported", _absent_metric, "MetricsMissing", f"decode-1:{m.KV_CACHE_USAGE}"),
])
def test_missing_or_stale_metrics_hold(name, damage, reason, in_message):
    samples, history = world({"waiting": 40}, {"kv": 1.0})  # would scale both up if trusted
    d = decide(damage(samples), {"prefill": 2, "decode": 2}, POLICY, history, NOW)
    assert d.desired == {"prefill": 2, "decode": 2}
    assert d.reason == reason and d.bottleneck is None
    active = next(c for c in d.conditions if c.type == "ScalingActive")
    assert (active.status, active.reason) == ("False", reason) and in_message in active.message
    assert d.history.recommendations == {}


def test_hold_still_moves_into_min_max():
    samples, history = world({"waiting": 8}, BUSY_DECODE)
    d = decide(_stale(samples), {"prefill": 0, "decode": 12}, POLICY, history, NOW)
    assert d.desired == {"prefill": 1, "decode": 10}
    assert (d.roles["prefill"].limited_by, d.roles["decode"].limited_by) == ("TooFewReplicas", "TooManyReplicas")


# ---------------------------------------------------------------- windows: up fast, down slow
def run(steps, policy, current):
    """steps: (t, prefill waiting total) -> desired prefill after each step; replicas follow the decision."""
    history, out = ScalingHistory(), []
    for t, waiting in steps:
        samples, prev = world({"waiting": waiting}, BUSY_DECODE, n_p=current, t=t)
        history = replace(history, last_samples=prev.last_samples)
        d = decide(samples, {"prefill": current, "decode": 2}, policy, history, t)
        history, current = d.history, d.desired["prefill"]
        out.append((current, d.roles["prefill"].reason))
    return out


@pytest.mark.parametrize("name, overrides, start, steps, expected", [
    ("down waits for the window", {"scale_down_window_seconds": 60}, 4,
     [(0, 16), (15, 0), (30, 0), (45, 0), (60, 0), (75, 0)],
     [(4, "WithinTolerance"), (4, "ScaleDownStabilizing"), (4, "ScaleDownStabilizing"),
      (4, "ScaleDownStabilizing"), (4, "ScaleDownStabilizing"), (1, "Underutilized")]),
    ("down goes to the window's highest", {"scale_down_window_seconds": 30}, 4,
     [(0, 16), (15, 8), (30, 0), (45, 0), (60, 0)],
     [(4, "WithinTolerance"), (4, "ScaleDownStabilizing"), (4, "ScaleDownStabilizing"), (2, "Underutilized"),
      (1, "Underutilized")]),
    ("up is immediate by default", {"scale_down_window_seconds": 300}, 2, [(0, 8), (15, 40)],
     [(2, "WithinTolerance"), (10, "PrefillBound")]),
    ("up window takes the lowest", {"scale_up_window_seconds": 30}, 2,
     [(0, 8), (15, 40), (30, 40), (45, 40)],
     [(2, "WithinTolerance"), (2, "ScaleUpStabilizing"), (2, "ScaleUpStabilizing"), (10, "PrefillBound")]),
    # a fresh history (first start, operator restart or failover: it lives in memory) knows nothing of the window
    # before it began: it holds the current size until one whole down window has been seen
    ("a fresh history holds a scale-down for one window", {"scale_down_window_seconds": 60}, 4,
     [(0, 0), (15, 0), (45, 0), (60, 0)],
     [(4, "ScaleDownStabilizing"), (4, "ScaleDownStabilizing"), (4, "ScaleDownStabilizing"), (1, "Underutilized")]),
    ("a fresh history scales up at once", {"scale_down_window_seconds": 300}, 2, [(0, 40)], [(10, "PrefillBound")]),
    ("a blip inside the down window does not flap", {"scale_down_window_seconds": 60}, 4,
     [(0, 16), (15, 0), (30, 16), (45, 0)],
     [(4, "WithinTolerance"), (4, "ScaleDownStabilizing"), (4, "WithinTolerance"), (4, "ScaleDownStabilizing")]),
])
def test_stabilization_windows(name, overrides, start, steps, expected):
    assert run(steps, replace(POLICY, **overrides), start) == expected


# ---------------------------------------------------------------- step, min/max, ratio bounds
@pytest.mark.parametrize("name, overrides, current, prefill, decode, desired, limited", [
    ("step up", {"max_step": 1}, (2, 2), {"waiting": 40}, BUSY_DECODE, (3, 2), ("StepLimited", None)),
    ("step down", {"max_step": 2}, (8, 2), IDLE, BUSY_DECODE, (6, 2), ("StepLimited", None)),
    ("max", {}, (2, 2), {"waiting": 80}, BUSY_DECODE, (10, 2), ("TooManyReplicas", None)),
    ("min", {"prefill": RoleBounds(3, 10)}, (4, 2), IDLE, BUSY_DECODE, (3, 2), ("TooFewReplicas", None)),
    ("min zero allowed", {"prefill": RoleBounds(0, 10)}, (2, 2), IDLE, BUSY_DECODE, (0, 2), (None, None)),
    # prefill/decode >= 1/2: decode to 6 pulls prefill up to 3
    ("ratio min raises prefill", {"ratio_min": (1, 2)}, (2, 2), {"waiting": 8}, {"kv": 2.4}, (3, 6),
     ("RatioBound", None)),
    # prefill/decode <= 1/1: prefill to 5 pulls decode up to 5
    ("ratio max raises decode", {"ratio_max": (1, 1)}, (2, 2), {"waiting": 20}, BUSY_DECODE, (5, 5),
     (None, "RatioBound")),
    ("ratio max, decode at its max: prefill capped", {"ratio_max": (1, 1), "decode": RoleBounds(1, 4)}, (2, 2),
     {"waiting": 20}, BUSY_DECODE, (4, 4), ("RatioBound", "RatioBound")),
    ("ratio inside bounds", {"ratio_min": (1, 4), "ratio_max": (2, 1)}, (2, 2), {"waiting": 12}, BUSY_DECODE,
     (3, 2), (None, None)),
])
def test_limits(name, overrides, current, prefill, decode, desired, limited):
    samples, history = world(prefill, decode, n_p=current[0], n_d=current[1])
    d = decide(samples, {"prefill": current[0], "decode": current[1]}, replace(POLICY, **overrides), history, NOW)
    assert (d.desired["prefill"], d.desired["decode"]) == desired
    assert (d.roles["prefill"].limited_by, d.roles["decode"].limited_by) == limited
    cond = next(c for c in d.conditions if c.type == "ScalingLimited")
    assert cond.status == ("True" if any(limited) else "False")


def test_policy_from_spec():
    spec = AutoscalingSpec.model_validate({
        "enabled": True, "intervalSeconds": 10, "tolerancePercent": 5, "maxStepPerInterval": 2,
        "prefill": {"minReplicas": 1, "maxReplicas": 6}, "decode": {"minReplicas": 2, "maxReplicas": 12},
        "targets": {"prefill": {"waitingRequestsPerPod": 3, "timeToFirstTokenMilliseconds": 800},
                    "decode": {"kvCacheUsagePercent": 75, "interTokenLatencyMilliseconds": 40},
                    "transfer": {"kvTransferTimeMilliseconds": 50, "pendingLoadsPerPod": 8}},
        "stabilization": {"scaleUpSeconds": 0, "scaleDownSeconds": 120},
        "prefillDecodeRatio": {"min": {"prefill": 1, "decode": 4}, "max": {"prefill": 1, "decode": 1}},
    })
    p = policy_from_spec(spec)
    assert (p.prefill, p.decode) == (RoleBounds(1, 6), RoleBounds(2, 12))
    assert (p.waiting_requests_per_pod, p.ttft_seconds, p.kv_cache_usage, p.itl_seconds) == (3, 0.8, 0.75, 0.04)
    assert (p.xfer_time_seconds, p.pending_loads_per_pod, p.pending_sends_per_pod) == (0.05, 8, 2.0)
    assert (p.tolerance, p.max_step, p.scale_up_window_seconds, p.scale_down_window_seconds) == (0.05, 2, 0, 120)
    assert (p.ratio_min, p.ratio_max, p.stale_after_seconds) == ((1, 4), (1, 1), 35)
    assert (p.latency_quantile, p.waiting_prompt_tokens_per_pod) == (0.9, None)
    assert policy_from_spec(AutoscalingSpec()).kv_cache_usage == 0.8
    tuned = policy_from_spec(AutoscalingSpec.model_validate({
        "latencyStatistic": "Mean", "staleAfterSeconds": 7, "targets": {"prefill": {"waitingPromptTokensPerPod": 512},
                                                                         "transfer": {"pendingSendsPerPod": 5}}}))
    assert (tuned.latency_quantile, tuned.stale_after_seconds) == (None, 7)
    assert (tuned.waiting_prompt_tokens_per_pod, tuned.pending_sends_per_pod) == (512, 5)
    assert policy_from_spec(AutoscalingSpec.model_validate({"latencyPercentile": 99})).latency_quantile == 0.99
    default = policy_from_spec(AutoscalingSpec())
    assert (default.scale_up_lookahead_seconds, default.max_step_percent, default.prefill_utilization) == (0, None, 1.0)
    aware = policy_from_spec(AutoscalingSpec.model_validate({
        "stabilization": {"scaleUpLookaheadSeconds": 45}, "maxStepPercentPerInterval": 100,
        "targets": {"prefill": {"utilizationPercent": 80}}}))
    assert (aware.scale_up_lookahead_seconds, aware.max_step_percent, aware.prefill_utilization) == (45, 100, 0.8)


# ---------------------------------------------------------------- start-up aware: starting pods, projected growth
AWARE = {"scale_up_lookahead_seconds": 45}


@pytest.mark.parametrize("name, overrides, decode, desired, reason", [
    # 2 of 4 decode pods serve (2 start): KV at 1.2x target on the 2 -> 2.4 pods' worth, the 4 cover it
    ("starting pods cover it", AWARE, {"kv": 0.96}, 4, "WithinTolerance"),
    ("beyond the starting pods", AWARE, {"kv": 2.4}, 6, "DecodeBound"),
    ("no scale-down while pods start", AWARE, {"kv": 0.2}, 4, "WithinTolerance"),
    ("not start-up aware: ratio x all replicas", {}, {"kv": 0.96}, 5, "DecodeBound"),
])
def test_starting_pods_count_as_capacity(name, overrides, decode, desired, reason):
    samples, history = world({"waiting": 8}, decode, n_p=2, n_d=2)
    d = decide(samples, {"prefill": 2, "decode": 4}, replace(POLICY, **overrides), history, NOW)
    assert (d.desired["decode"], d.roles["decode"].reason) == (desired, reason)


def prefill_pods(t: float, n: int, waiting_tokens: float, served_tokens: float, waiting: float = 8) -> list:
    """n prefill pods: the queue (requests, prompt tokens) and the vllm:prompt_tokens counter split evenly."""
    return [PodSample(f"prefill-{i}", "prefill", t, {m.NUM_REQUESTS_WAITING: waiting / n,
                                                    m.WAITING_PROMPT_TOKENS: waiting_tokens / n,
                                                    PROMPT_TOKENS: served_tokens / n}) for i in range(n)]


def run_prefill(policy, reads, n=2):
    """reads: (t, waiting prompt tokens, prompt tokens served so far, waiting requests) -> the last decision."""
    history = ScalingHistory()
    for t, tokens, served, waiting in reads:
        samples = {"prefill": prefill_pods(t, n, tokens, served, waiting),
                   "decode": [pod_sample("decode", i, t, 2, BUSY_DECODE, 0) for i in range(2)]}
        d = decide(samples, {"prefill": n, "decode": 2}, policy, history, t)
        history = d.history
    return d


@pytest.mark.parametrize("name, overrides, reads, desired, reason", [
    # 2 pods serve 2000 tokens/s while the queue grows 1000 tokens/s: arrival 3000/s needs 3 pods, and the queue
    # projected 45 s ahead (60k tokens) drained over the next 45 s needs 1.33 more -> 5, while the queue (8
    # requests) is still at its target
    ("growth scales up before the queue breaches", AWARE, [(0, 0, 0, 8), (15, 15_000, 30_000, 8)], 5,
     "PrefillBound"),
    ("same reads, not start-up aware", {}, [(0, 0, 0, 8), (15, 15_000, 30_000, 8)], 2, "WithinTolerance"),
    ("no queue, throughput unknown: no projection", AWARE, [(0, 0, 0, 8), (15, 0, 15_000, 8)], 2,
     "WithinTolerance"),
    # busy the whole window (queue at both reads): 1000 tokens/s a pod; arrival 2000/s at 80% busy -> 2.5 pods
    ("measured throughput at the utilization target", {**AWARE, "prefill_utilization": 0.8},
     [(0, 2000, 0, 8), (15, 2000, 30_000, 8)], 3, "PrefillBound"),
    # the queue empties: the projection never scales down; the queue target does (to 1, down window 0)
    ("shrinking queue is no scale-down signal", AWARE, [(0, 30_000, 0, 8), (15, 0, 30_000, 0)], 1,
     "Underutilized"),
    # busy pods, 1 request waiting: the queue target alone says 1 pod, the measured throughput says 2.04 are needed
    # (inside the tolerance of 2: no scale-up either)
    ("throughput floors the scale-down", AWARE, [(0, 2000, 0, 8), (15, 2000, 30_000, 1)], 2, "WithinTolerance"),
])
def test_prefill_projection(name, overrides, reads, desired, reason):
    d = run_prefill(replace(POLICY, ttft_seconds=None, **overrides), reads)
    assert (d.desired["prefill"], d.roles["prefill"].reason) == (desired, reason)


@pytest.mark.parametrize("name, overrides, before, now, desired", [
    # KV 0.3 -> 0.6 in 15 s: 1.5 projected 45 s ahead on 2 pods at target 0.8 -> 3.75 -> 4, before any breach
    ("KV growth scales up ahead", AWARE, 0.3, 0.6, 4),
    ("not start-up aware", {}, 0.3, 0.6, 2),
    ("falling KV: no projection", AWARE, 0.9, 0.6, 2),
])
def test_decode_projection(name, overrides, before, now, desired):
    samples, history = world({"waiting": 8}, {"kv": now})
    history = replace(history, levels={"decode": RoleLevels(NOW - INTERVAL, 0.0, before, None)})
    d = decide(samples, {"prefill": 2, "decode": 2}, replace(POLICY, **overrides), history, NOW)
    assert d.desired["decode"] == desired
    assert d.history.levels["decode"].kv_cache_usage == now


@pytest.mark.parametrize("name, overrides, current, prefill, desired", [
    ("percent step doubles", {"max_step": 1, "max_step_percent": 100}, 4, {"waiting": 200}, 8),
    ("fixed step when larger", {"max_step": 6, "max_step_percent": 100}, 4, {"waiting": 200}, 10),
    ("percent step is for scale-up only", {"max_step": 1, "max_step_percent": 100}, 8, IDLE, 7),
])
def test_percent_step(name, overrides, current, prefill, desired):
    samples, history = world(prefill, BUSY_DECODE, n_p=current)
    d = decide(samples, {"prefill": current, "decode": 2}, replace(POLICY, prefill=RoleBounds(1, 50), **overrides),
               history, NOW)
    assert d.desired["prefill"] == desired


def test_policy_from_spec_leaves_start_up_awareness_off():
    p = policy_from_spec(AutoscalingSpec())
    assert (p.scale_up_lookahead_seconds, p.max_step_percent, p.prefill_utilization) == (0.0, None, 1.0)
