"""The autoscaler on vLLM workers' metrics: vLLM exports the vllm: names but none of our disagg: gauges, and counts
requests waiting for remote KV by load stage instead of disagg:kv_pending_loads. The decision reads what there is,
never takes an absent gauge for zero, and says in status which signals it used."""
from __future__ import annotations

from disagg.operator.autoscaling.inputs import AutoscalePolicy
from disagg.operator.autoscaling.policy import ScalingHistory, decide
from disagg.operator.autoscaling.samples import VLLM_PENDING_LOADS, pod_load
from disagg.operator.autoscaling.sources import parse_prometheus_text

# the shape of vLLM 0.32's exposition on a decode worker (kv_consumer): labels engine + model_name, no role
VLLM_DECODE = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} {running}
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny"} 0.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} {usage}
# TYPE vllm:num_requests_kv_fetch_by_stage gauge
vllm:num_requests_kv_fetch_by_stage{engine="0",model_name="tiny",stage="waiting_to_start"} {start}
vllm:num_requests_kv_fetch_by_stage{engine="0",model_name="tiny",stage="in_progress"} {progress}
vllm:num_requests_kv_fetch_by_stage{engine="0",model_name="tiny",stage="completed_waiting"} 5.0
# TYPE vllm:nixl_num_failed_transfers_total counter
vllm:nixl_num_failed_transfers_total{engine="0",model_name="tiny"} 0.0
"""
VLLM_PREFILL = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 0.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny"} 1.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.1
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="tiny"} 120.0
"""


def decode_text(running=1.0, usage=0.2, start=0.0, progress=0.0) -> str:
    return (VLLM_DECODE.replace("{running}", str(running)).replace("{usage}", str(usage))
            .replace("{start}", str(start)).replace("{progress}", str(progress)))


def test_pending_loads_come_from_vllms_fetch_stages_not_yet_loaded():
    s = parse_prometheus_text(decode_text(start=2.0, progress=3.0), pod="d-0", role="decode", timestamp=1.0)
    assert s.values[VLLM_PENDING_LOADS] == 5.0  # completed_waiting is loaded already: not counted
    assert pod_load(s) == 1.0 + 5.0  # a decode pod holding loads in flight is not the one to remove


def _decide(prefill: str, decode: str, policy: AutoscalePolicy):
    samples = {"prefill": [parse_prometheus_text(prefill, pod="p-0", role="prefill", timestamp=100.0)],
               "decode": [parse_prometheus_text(decode, pod="d-0", role="decode", timestamp=100.0)]}
    return decide(samples, {"prefill": 1, "decode": 1}, policy, ScalingHistory(), 100.0)


def test_the_decision_names_the_signals_vllm_lacks_and_does_not_read_them_as_zero():
    d = _decide(VLLM_PREFILL, decode_text(usage=0.3), AutoscalePolicy(pending_loads_per_pod=4))
    assert "pendingSends" in d.signals["prefill"]["unavailable"]
    assert "waitingPromptTokens" in d.signals["prefill"]["unavailable"]
    assert {"waitingRequests", "promptTokensRate"} <= set(d.signals["prefill"]["used"])
    assert {"kvCacheUsage", "pendingLoads", "failedTransfers"} <= set(d.signals["decode"]["used"])
    assert d.metrics["prefill_pending_sends_per_pod"] is None  # not measured: not told as 0
    assert d.metrics["prefill_waiting_prompt_tokens_per_pod"] is None
    assert d.metrics["prefill_waiting_requests_per_pod"] == 1.0
    assert d.metrics["decode_pending_loads_per_pod"] == 0.0  # measured (vLLM's stages), and zero
    assert d.desired == {"prefill": 1, "decode": 1}


def test_vllm_pending_loads_drive_the_transfer_signal():
    """Requests waiting for remote KV over the target: a transfer problem, so neither pool grows."""
    d = _decide(VLLM_PREFILL, decode_text(usage=0.3, start=6.0, progress=4.0), AutoscalePolicy(pending_loads_per_pod=4))
    assert d.metrics["decode_pending_loads_per_pod"] == 10.0
    assert d.bottleneck == "TransferBound" and d.desired == {"prefill": 1, "decode": 1}


# a router's page: what it measured per endpoint (router/handoffs.py), for the prefill pod p-0 and decode pod d-0
ROUTER = """\
# TYPE disagg:router_kv_pending_sends gauge
disagg:router_kv_pending_sends{endpoint="http://10.0.0.1:8000",endpoint_pod="p-0",model_name="tiny",role="router"} {sends}
# TYPE disagg:router_kv_pending_loads gauge
disagg:router_kv_pending_loads{endpoint="http://10.0.0.2:8000",endpoint_pod="d-0",model_name="tiny",role="router"} 1.0
"""


def _decide_with_routers(routers: list[str], policy: AutoscalePolicy):
    from disagg.operator.autoscaling.samples import attribute_handoff_signals

    samples = attribute_handoff_signals(
        [parse_prometheus_text(VLLM_PREFILL, pod="p-0", role="prefill", timestamp=100.0),
         parse_prometheus_text(decode_text(usage=0.95), pod="d-0", role="decode", timestamp=100.0),
         *(parse_prometheus_text(r, pod=f"router-{i}", role="router", timestamp=100.0) for i, r in enumerate(routers))])
    by_role = {role: [s for s in samples if s.role == role] for role in ("prefill", "decode")}
    return decide(by_role, {"prefill": 1, "decode": 1}, policy, ScalingHistory(), 100.0)


def test_the_routers_view_gives_vllm_pods_the_kv_back_pressure_signal():
    """Decode KV full and KV piling up at the prefill (its sends not pulled): a decode shortage, read for vLLM
    pods from what the routers measured per endpoint (summed over routers)."""
    d = _decide_with_routers([ROUTER.replace("{sends}", "3.0"), ROUTER.replace("{sends}", "2.0")],
                             AutoscalePolicy(pending_sends_per_pod=2.0))
    assert "pendingSends" in d.signals["prefill"]["used"]
    assert d.metrics["prefill_pending_sends_per_pod"] == 5.0
    assert d.desired["decode"] == 2 and d.desired["prefill"] == 1  # never prefill for a decode bottleneck
    assert d.bottleneck == "DecodeBound"


def test_without_a_router_page_the_signal_stays_unavailable():
    d = _decide_with_routers([], AutoscalePolicy())
    assert "pendingSends" in d.signals["prefill"]["unavailable"]
