"""The autoscaling pass both the operator and `disagg up` run: scrape -> decide -> choose who leaves -> report,
stepped with scripted samples and an injected clock."""
from __future__ import annotations

from disagg.operator.autoscaling import samples as ms
from disagg.operator.autoscaling.inputs import AutoscalePolicy, RoleBounds
from disagg.operator.autoscaling.scaling_pass import PassState, run_pass

POLICY = AutoscalePolicy(prefill=RoleBounds(1, 1), decode=RoleBounds(1, 3), waiting_requests_per_pod=None,
                         kv_cache_usage=0.5, scale_down_window_seconds=0, max_step=2)
MEMBERS = {"prefill": ["p-0"], "decode": ["d-2", "d-1", "d-0"]}  # newest first


def scrape(kv: float, now: float, running: dict[str, float] | None = None):
    running = running or {}
    return lambda: [ms.PodSample(name, role, now, {ms.KV_CACHE_USAGE: kv,
                                                   ms.NUM_REQUESTS_RUNNING: running.get(name, 0)})
                    for role, names in MEMBERS.items() for name in names]


def step(kv: float, now: float, state: PassState, dry_run: bool, current: int = 3, running=None):
    return run_pass(scrape(kv, now, running), MEMBERS, {"prefill": 1, "decode": current}, POLICY, state, now, dry_run)


def test_dry_run_tells_a_would_be_change_once_until_the_decision_moves():
    # STEP 1: decode at 10 % of a 50 % target -> 3 -> 1 (step 2), told
    first = step(0.1, 100.0, PassState(), dry_run=True)
    assert [(c.role, c.from_replicas, c.to_replicas, c.reason, c.dry_run) for c in first.changes] == \
        [("decode", 3, 1, "Underutilized", True)]
    assert first.removals == {}, "a dry run removes nothing"
    assert first.changes[0].metrics["decode_kv_cache_usage"] == 0.1 and first.changes[0].time == 100.0
    # STEP 2: the same would-be change: not told again
    second = step(0.1, 101.0, first.state, dry_run=True)
    assert second.changes == [] and second.decision.desired["decode"] == 1
    # STEP 3: on target: no change wanted; STEP 4: the same change again is news
    third = step(0.5, 102.0, second.state, dry_run=True)
    assert third.changes == []
    fourth = step(0.1, 103.0, third.state, dry_run=True)
    assert [c.to_replicas for c in fourth.changes] == [1]


def test_a_scale_down_names_the_least_loaded_members_and_every_change_is_told():
    busy = {"d-0": 4, "d-1": 1, "d-2": 1}
    first = step(0.1, 100.0, PassState(), dry_run=False, running=busy)
    assert first.removals == {"decode": ["d-2", "d-1"]}, "least loaded, ties: the newest"
    again = step(0.1, 101.0, first.state, dry_run=False, running=busy)
    assert [c.to_replicas for c in again.changes] == [1], "applied changes are told every time"
    missing = run_pass(lambda: [], MEMBERS, {"prefill": 1, "decode": 3}, POLICY, PassState(), 100.0, False)
    assert (missing.decision.reason, missing.changes, missing.removals) == ("MetricsMissing", [], {})
