"""`disagg up --gateway` with engine vllm: a real Envoy with our endpoint picker in front of 1 prefill + 1 decode
`vllm serve`, each behind `disagg pd-proxy` as in a pod. The picker names the decode worker and its prefill
target; the decode's pd-proxy runs the prefill hop and vLLM pulls the KV over NIXL. Greedy answers through the
gateway equal one colocated vLLM's (the router path's tests hold the same reference); bad input is refused with
the same 400; SIGINT stops Envoy, the picker, the proxies and vLLM."""
from __future__ import annotations

import signal

import httpx
import pytest
from serving_helpers import metric_sum
from test_vllm_up import vllm_spec
from vllm_env import KINDS, STARTUP_S, disagg_up, generate

from disagg.worker.local.process import free_port


@pytest.fixture(scope="module")
def up(vllm_executable, vllm_model_dir, reference_texts, tmp_path_factory):
    pytest.importorskip("grpc", reason="the endpoint picker needs the gateway extra (pip install 'disagg[gateway]')")
    tmp = tmp_path_factory.mktemp("vllm-gateway")
    port = free_port()
    with disagg_up(vllm_spec(vllm_model_dir), tmp, vllm_executable, port, STARTUP_S, "  -> ", ["--gateway"]) as up:
        yield {**up, "gateway": f"http://127.0.0.1:{port}"}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_pd_through_the_gateway_equals_one_colocated_vllm(up, reference_texts, kind, stream):
    assert generate(up["gateway"], kind, stream) == reference_texts[kind]


def test_the_kv_came_over_nixl_through_the_decodes_prefill_hop(up):
    decode, prefill = up["urls"]["decode-0"], up["urls"]["prefill-0"]
    reads = metric_sum(decode, "vllm:nixl_xfer_time_seconds_count")
    prompts = metric_sum(prefill, "vllm:prompt_tokens_total")
    generate(up["gateway"], "completion", False)
    assert metric_sum(decode, "vllm:nixl_xfer_time_seconds_count") > reads
    assert metric_sum(prefill, "vllm:prompt_tokens_total") > prompts
    assert metric_sum(decode, "vllm:nixl_bytes_transferred_sum") > 0


def test_bad_input_gets_the_same_400(up):
    r = httpx.post(f"{up['gateway']}/v1/completions", timeout=60,
                   json={"model": "tiny-vllm", "prompt": "x", "max_tokens": "many"})
    assert r.status_code == 400 and "max_tokens" in r.text, r.text


def test_sigint_stops_envoy_the_picker_and_every_vllm(up):
    launcher = up["launcher"]
    launcher.send_signal(signal.SIGINT)
    assert launcher.wait(180) == 0
    for url in [up["gateway"], *up["urls"].values()]:
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"{url}/health", timeout=2)
    assert "stopped" in up["output"]()
