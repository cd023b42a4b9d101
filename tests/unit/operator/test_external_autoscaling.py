"""spec.autoscaling.mode external: an outside autoscaler (HPA, KEDA) writes spec.decode.replicas through the
resource's /scale subresource; the operator applies it, keeps prefill in step within prefillDecodeRatio and
prefill's min/max, runs no policy of its own, and reports the decode pods' selector for the HPA."""
from __future__ import annotations

import pytest
from k8s_patch import apply_merge_patch
from test_reconcile import FakeCluster, example, replicas, run_pass

from disagg.operator import spec as s
from disagg.operator.crd import SCALE
from disagg.operator.handlers import _autoscaling_on
from disagg.operator.plan import initial_replicas, prefill_following


def external(decode: int, prefill: int = 1, ratio: dict | None = None) -> dict:
    doc = example()
    doc["spec"]["autoscaling"].update(mode="external", prefill={"minReplicas": 1, "maxReplicas": 4},
                                      decode={"minReplicas": 0, "maxReplicas": 8},
                                      prefillDecodeRatio=ratio or {"min": {"prefill": 1, "decode": 2},
                                                                   "max": {"prefill": 1, "decode": 1}})
    doc["spec"]["decode"]["replicas"], doc["spec"]["prefill"]["replicas"] = decode, prefill
    return doc


@pytest.mark.parametrize("prefill, decode, want", [
    (1, 2, 1), (1, 6, 3),  # at least 1 prefill per 2 decode
    (4, 2, 2),  # at most 1 prefill per decode
    (1, 20, 4),  # prefill's maxReplicas wins over the ratio
    (1, 0, 1),  # decode at zero: prefill at its minReplicas
])
def test_prefill_follows_decode_within_the_ratio_and_its_bounds(prefill, decode, want):
    spec = s.parse_spec(external(decode, prefill)["spec"])
    assert initial_replicas(spec, "prefill") == want
    assert initial_replicas(spec, "decode") == min(decode, 8)


def test_no_ratio_leaves_prefill_as_the_spec_says():
    assert prefill_following(3, 8, s.PrefillDecodeRatio()) == 3


def test_scale_writes_reach_the_deployments_and_the_policy_stays_off():
    cluster = FakeCluster()
    body = cluster.add_resource(external(decode=2))
    run_pass(cluster)
    assert replicas(cluster) == (1, 2)
    status = cluster.resource()["status"]
    assert status["decode"]["selector"] == ("app.kubernetes.io/component=decode,app.kubernetes.io/instance="
                                            "llama3-8b,app.kubernetes.io/name=disagg")
    assert "autoscaling" not in status
    # an HPA writes /scale: spec.decode.replicas (SCALE's specReplicasPath) -> decode 6, prefill follows to 3
    assert SCALE["specReplicasPath"] == ".spec.decode.replicas"
    cluster.objects[(s.KIND, "ns", "llama3-8b")] = apply_merge_patch(
        cluster.resource(), {"spec": {"decode": {"replicas": 6}}, "metadata": {"generation": 2}})
    run_pass(cluster)
    assert replicas(cluster) == (3, 6)
    assert not _autoscaling_on(spec=body["spec"]) and _autoscaling_on(spec=example()["spec"])
