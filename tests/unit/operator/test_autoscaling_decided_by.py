"""Which signals decided each role: the ones whose recommendation the role's is (the largest asked for), or the ones
that held it back (KV waiting at prefill holds prefill for a decode shortage; slow or failing transfers hold
both). Told in disagg up's /status and console line and in the operator's ScalingActive condition. The loads are
test_autoscaling_policy's bottleneck table."""
from __future__ import annotations

from dataclasses import replace

import pytest
from test_autoscaling_policy import CASES, NOW, POLICY, world

from disagg.operator.autoscaling.policy import decide
from disagg.operator.autoscaling.report import decision_json, scaling_line
from disagg.operator.autoscaling.scaling_pass import PassState, run_pass

LOADS = {c[0]: c[1:4] for c in CASES}
# case -> (prefill decided by, decode decided by)
DECIDED = [
    ("at target", [], []),
    ("prefill queue", ["waitingRequests"], []),
    ("prefill TTFT", ["timeToFirstToken"], []),
    ("decode KV usage", [], ["kvCacheUsage"]),
    ("decode ITL", [], ["interTokenLatency"]),
    ("KV waits to be pulled", ["pendingSends"], ["pendingSends"]),
    ("decode over + back-pressure", ["pendingSends"], ["pendingSends"]),
    ("expired leases", [], ["expiredLeases"]),
    ("both pools over, KV pulled", ["waitingRequests"], ["kvCacheUsage"]),
    ("transfer slow, pools fine", ["transferTime"], ["transferTime"]),
    ("pending loads over target", ["pendingLoads"], ["pendingLoads"]),
    ("failed transfers", ["failedTransfers"], ["failedTransfers"]),
    ("underutilized", ["waitingRequests"], ["kvCacheUsage"]),
]


def _decide(name: str):
    prefill, decode, overrides = LOADS[name]
    samples, history = world(prefill, decode)
    return decide(samples, {"prefill": 2, "decode": 2}, replace(POLICY, **overrides), history, NOW)


@pytest.mark.parametrize("name, prefill, decode", DECIDED, ids=[c[0] for c in DECIDED])
def test_the_decision_names_the_signals_that_decided_each_role(name, prefill, decode):
    d = _decide(name)
    assert d.decided_by == {"prefill": prefill, "decode": decode}
    assert {r: x["decidedBy"] for r, x in decision_json(d, False)["roles"].items()} == d.decided_by
    active = next(c for c in d.conditions if c.type == "ScalingActive")
    for role, names in d.decided_by.items():
        assert (f"{role} by {', '.join(names)}" in active.message) == bool(names), active.message


def test_a_change_tells_what_decided_it():
    prefill, decode, overrides = LOADS["KV waits to be pulled"]
    samples, history = world(prefill, decode)
    outcome = run_pass(lambda: [*samples["prefill"], *samples["decode"]], {}, {"prefill": 2, "decode": 2},
                       replace(POLICY, **overrides), PassState(history=history), NOW, dry_run=True)
    (change,) = outcome.changes
    assert (change.role, change.reason, change.decided_by) == ("decode", "DecodeBound", ["pendingSends"])
    assert change.as_json()["decidedBy"] == ["pendingSends"]
    assert "decode 2 -> 6 (DecodeBound) by pendingSends " in scaling_line(change)
