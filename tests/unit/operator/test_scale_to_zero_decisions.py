"""Scale to zero's decisions (autoscaling/zero.py) and their place in the shared pass: idle for idleSeconds ->
both pools 0; at zero they stay there until a router holds a request, then both come back at once; anything in
flight, or a replica not read, keeps them up."""
from __future__ import annotations

import pytest

from disagg.operator.autoscaling.inputs import AutoscalePolicy, RoleBounds
from disagg.operator.autoscaling.report import ScalingChange
from disagg.operator.autoscaling.samples import (
    HELD_REQUESTS, NUM_REQUESTS_RUNNING, PENDING_SENDS, TTFT, Histogram, PodSample,
)
from disagg.operator.autoscaling.scaling_pass import PassState, run_pass
from disagg.operator.autoscaling.zero import ZeroState, zero_step

MINS = {"prefill": 1, "decode": 2}
UP = {"prefill": 1, "decode": 2}
ZERO = {"prefill": 0, "decode": 0}


def pods(prefill: float = 0, decode: float = 0, held: float = 0, missing: bool = False, n=UP) -> list[PodSample]:
    out = [PodSample(f"{role}-{i}", role, 100.0, {NUM_REQUESTS_RUNNING: load if i == 0 else 0.0})
           for role, load in (("prefill", prefill), ("decode", decode)) for i in range(n[role])]
    out.append(PodSample("router-0", "router", 100.0, {HELD_REQUESTS: held}, error="refused" if missing else None))
    return out


def test_off_never_overrides():
    step = zero_step(None, MINS, pods(), UP, ZeroState(idle_since=0.0), 1000.0)
    assert step.desired is None and step.state == ZeroState()


def test_idle_for_idle_seconds_takes_both_pools_to_zero():
    s1 = zero_step(60, MINS, pods(), UP, ZeroState(), 100.0)
    assert s1.desired is None and s1.state.idle_since == 100.0
    s2 = zero_step(60, MINS, pods(), UP, s1.state, 159.0)
    assert s2.desired is None
    s3 = zero_step(60, MINS, pods(), UP, s2.state, 160.0)
    assert s3.desired == ZERO and s3.reason == "ScaledToZero"
    assert s3.state.zero_since == 160.0 and "idle for 60 s" in s3.state.reason


@pytest.mark.parametrize("busy", [dict(prefill=1), dict(decode=2), dict(held=1), dict(missing=True)])
def test_anything_in_flight_or_unread_restarts_the_idle_clock(busy):
    state = ZeroState(idle_since=0.0)
    step = zero_step(60, MINS, pods(**busy), UP, state, 1000.0)
    assert step.desired is None and step.state.idle_since is None


def served(first_tokens: float, restarted: bool = False) -> list[PodSample]:
    """Nothing in flight at the read, `first_tokens` counted by decode-0 so far (a new pod name: restarted)."""
    samples = pods()
    ttft = Histogram(((float("inf"), first_tokens),), 0.1 * first_tokens, first_tokens)
    decode = next(s for s in samples if s.pod == "decode-0")
    if restarted:
        decode.pod = "decode-0b"
    decode.histograms[TTFT] = ttft
    return samples


def test_requests_served_between_reads_are_not_idleness():
    """Light traffic: a short request every 30 s, each over before the next read - no read sees one in flight,
    yet the pools serve. They stay up; once no first token is counted for idleSeconds, they go."""
    state, now = ZeroState(), 100.0
    for n in range(1, 8):  # 7 passes 30 s apart over 180 s, idleSeconds 60: a request finished between each
        step = zero_step(60, MINS, served(n), UP, state, now)
        assert step.desired is None, (n, step)
        state, now = step.state, now + 30
    assert state.idle_since is None
    quiet = [zero_step(60, MINS, served(7), UP, state, now)]
    for t in (now + 30, now + 60):
        quiet.append(zero_step(60, MINS, served(7), UP, quiet[-1].state, t))
    assert [q.desired for q in quiet] == [None, None, ZERO] and quiet[0].state.idle_since == now


def test_a_restarted_worker_counting_from_zero_is_not_a_request():
    first = zero_step(60, MINS, served(40), UP, ZeroState(), 100.0)
    after = zero_step(60, MINS, served(0, restarted=True), UP, first.state, 130.0)
    assert after.state.idle_since == 100.0  # decode-0b was not read before: nothing to compare


def test_kv_pending_or_a_replica_without_a_sample_is_not_idle():
    samples = pods()
    samples[0].values[PENDING_SENDS] = 1.0
    assert zero_step(60, MINS, samples, UP, ZeroState(idle_since=0.0), 1000.0).state.idle_since is None
    assert zero_step(60, MINS, pods(), {"prefill": 2, "decode": 2}, ZeroState(idle_since=0.0),
                     1000.0).state.idle_since is None


def test_at_zero_stays_there_until_a_request_is_held_then_both_come_back():
    at = zero_step(60, MINS, pods(n=ZERO), ZERO, ZeroState(zero_since=5.0, reason="idle"), 100.0)
    assert at.desired == ZERO and at.reason == "AtZero" and at.state.zero_since == 5.0
    back = zero_step(60, MINS, pods(held=3, n=ZERO), ZERO, at.state, 101.0)
    assert back.desired == {"prefill": 1, "decode": 2} and back.reason == "ScaledFromZero" and back.held == 3
    assert back.state.left_zero_at == 101.0 and back.state.zero_since is None


def test_a_pool_the_policy_put_at_zero_alone_is_the_policys():
    """prefill minReplicas 0: prefill at zero with decode serving is today's decode-alone fallback."""
    step = zero_step(60, {"prefill": 0, "decode": 1}, pods(decode=1, n={"prefill": 0, "decode": 1}),
                     {"prefill": 0, "decode": 1}, ZeroState(), 100.0)
    assert step.desired is None


def test_the_pass_scales_both_pools_to_zero_prefill_first_and_tells_it_as_transitions():
    policy = AutoscalePolicy(prefill=RoleBounds(1, 2), decode=RoleBounds(1, 2), idle_to_zero_seconds=10,
                             scale_down_window_seconds=0)
    members = {"prefill": ["p-0"], "decode": ["d-0"]}
    current = {"prefill": 1, "decode": 1}

    def read(now, held=0.0, n=current):
        return lambda: [PodSample(f"{r[0]}-0", r, now, {NUM_REQUESTS_RUNNING: 0.0}) for r in ("prefill", "decode")
                        if n[r]] + [PodSample("router", "router", now, {HELD_REQUESTS: held})]

    first = run_pass(read(0.0), members, current, policy, PassState(), 0.0, dry_run=False)
    assert first.changes == []
    out = run_pass(read(10.0), members, current, policy, first.state, 10.0, dry_run=False)
    assert [(c.role, c.to_replicas, c.event_reason) for c in out.changes] == [
        ("prefill", 0, "ScaledToZero"), ("decode", 0, "ScaledToZero")]
    assert out.removals == {"prefill": ["p-0"], "decode": ["d-0"]} and out.at_zero
    idle = run_pass(read(11.0, n=ZERO), {}, ZERO, policy, out.state, 11.0, dry_run=False)
    assert idle.changes == [] and idle.at_zero  # min 1 does not bring them back without demand
    back = run_pass(read(12.0, held=1, n=ZERO), {}, ZERO, policy, idle.state, 12.0, dry_run=False)
    assert [(c.role, c.to_replicas, c.event_reason) for c in back.changes] == [
        ("prefill", 1, "ScaledFromZero"), ("decode", 1, "ScaledFromZero")]
    assert not back.at_zero


def test_scale_to_zero_events_are_named_for_the_transition():
    assert ScalingChange("decode", 1, 0, "ScaledToZero", False, 0.0).event_reason == "ScaledToZero"
    assert ScalingChange("decode", 2, 1, "Underutilized", False, 0.0).event_reason == "ScaledDown"


def test_status_says_why_the_pools_are_at_zero_since_when_and_when_they_left():
    from disagg.operator.autoscaling.cluster import zero_status
    from disagg.operator.autoscaling.zero import ZeroStep

    assert zero_status(ZeroStep(None, None, ZeroState(), 0), {}) is None  # scale to zero off
    went = zero_step(60, MINS, pods(), UP, ZeroState(idle_since=0.0), 60.0)
    st = zero_status(went, {})
    assert st["atZero"] and st["since"] == "1970-01-01T00:01:00Z" and st["reason"].startswith("idle for 60 s")
    later = zero_status(zero_step(60, MINS, pods(n=ZERO), ZERO, ZeroState(), 500.0), st)  # operator restarted
    assert later["since"] == st["since"], later  # the time status already told is kept
    back = zero_status(zero_step(60, MINS, pods(held=2, n=ZERO), ZERO, went.state, 600.0), later)
    assert back == {"atZero": False, "heldRequests": 2, "leftZeroAt": "1970-01-01T00:10:00Z"}


def test_scale_to_zero_without_autoscaling_is_rejected_by_name():
    from disagg.operator.checks import check_spec

    raw = {"model": {"servedName": "m"}, "autoscaling": {"scaleToZero": {"enabled": True}}}
    _, problems = check_spec(raw, "local")
    assert [p.path for p in problems] == ["spec.autoscaling.scaleToZero.enabled"], problems
    raw["autoscaling"]["enabled"] = True
    assert check_spec(raw, "local")[1] == []
