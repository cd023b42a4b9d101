"""The replicas a worker pool starts with - one rule for the operator's Deployments and `disagg up`'s processes:
spec.<role>.replicas, moved into autoscaling's min/max only when the autoscaler applies its decisions (a dry run
applies nothing, so the spec's number stands)."""
from __future__ import annotations

import pytest

from disagg.operator import manifests as m
from disagg.operator.naming import child_name
from disagg.operator.plan import autoscaler_owns_replicas, check_local, initial_replicas
from disagg.operator.reconcile import apply_children
from disagg.operator.spec import parse_spec
from disagg.worker.local.launcher import plan

CASES = [  # (decode replicas, autoscaling enabled, dry run, min, max) -> (autoscaler owns, starts with)
    ((3, False, False, 1, 2), (False, 3)),  # off: as written, even outside min/max
    ((0, False, False, 1, 2), (False, 0)),
    ((3, True, False, 1, 2), (True, 2)),  # on: moved into [min, max]
    ((0, True, False, 1, 2), (True, 1)),
    ((2, True, False, 1, 4), (True, 2)),
    ((3, True, True, 1, 2), (False, 3)),  # dry run: nothing is applied, the spec's number stands
    ((0, True, True, 1, 2), (False, 0)),
]


def spec_with(replicas: int, enabled: bool, dry_run: bool, lo: int, hi: int):
    return parse_spec({"model": {"servedName": "tiny", "source": {"path": "/opt/m"}}, "decode": {"replicas": replicas},
                       "autoscaling": {"enabled": enabled, "dryRun": dry_run,
                                       "decode": {"minReplicas": lo, "maxReplicas": hi}}})


@pytest.mark.parametrize("given, want", CASES, ids=[str(c[0]) for c in CASES])
def test_initial_replicas(given, want):
    spec = spec_with(*given)
    assert (autoscaler_owns_replicas(spec), initial_replicas(spec, "decode")) == want


@pytest.mark.parametrize("given, want", CASES, ids=[str(c[0]) for c in CASES])
def test_the_operator_and_disagg_up_start_the_same_pool(given, want):
    spec = spec_with(*given)

    class Empty:  # a cluster with no children yet: the pass creates each with the planned replicas
        def __init__(self):
            self.created = []

        def get(self, *_):
            return None

        def create(self, obj):
            self.created.append(obj)
            return obj

    cluster = Empty()
    apply_children(cluster, m.Owner("x", "ns", "u"), spec)
    [created] = [c for c in cluster.created
                 if c["kind"] == "Deployment" and c["metadata"]["name"] == child_name("x", "decode")]
    ports = iter(range(9000, 9100))
    local = [p for p in plan(spec, "/ckpt", "127.0.0.1", 8000, lambda: next(ports), "/kv").processes if p.role == "decode"]
    assert created["spec"]["replicas"] == len(local) == want[1]


def test_disagg_up_refuses_a_plan_without_a_decode_worker():
    problems = {str(p) for p in check_local(spec_with(0, True, True, 1, 2).model_dump(by_alias=True))[1]}
    assert problems == {"spec.decode.replicas: must be >= 1 to serve locally"}
    problems = {str(p) for p in check_local(spec_with(2, True, False, 0, 2).model_dump(by_alias=True))[1]}
    assert problems == {"spec.autoscaling.decode.minReplicas: must be >= 1 to serve locally, got 0"}
    assert check_local(spec_with(0, True, False, 1, 2).model_dump(by_alias=True))[1] == []
