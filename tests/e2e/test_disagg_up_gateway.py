"""`disagg up --gateway` end to end: the bundled example (1 prefill + 2 decode, NIXL) behind a real Envoy whose
ext_proc is our endpoint picker - the Gateway API inference gateway topology on one machine. Through Envoy:
completions and chat, streamed and not, match one colocated worker token for token (greedy); `n` and logprobs
come back whole; KV moved prefill -> decode over NIXL (the decode worker's own prefill hop, signed); bad input is
the worker's 400 naming the field; Ctrl-C stops Envoy, the picker and every worker."""
from __future__ import annotations

import signal
import subprocess

import httpx
import pytest
import yaml
from serving_helpers import NIXL_MISSING, metric, nixl_available
from test_disagg_up import CLI, REPO, alive, children_of, generate, reference, wait_for  # noqa: F401 (fixture)

from disagg.worker.local.process import free_port

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not nixl_available(), reason=NIXL_MISSING)]


@pytest.fixture(scope="module")
def up(tmp_path_factory, reference):  # noqa: F811
    pytest.importorskip("grpc", reason="the endpoint picker needs the gateway extra (pip install 'disagg[gateway]')")
    tmp = tmp_path_factory.mktemp("up-gateway")
    doc = yaml.safe_load((REPO / "examples" / "local.yaml").read_text())
    doc["spec"]["kvTransfer"]["leaseSeconds"] = 5
    spec_file = tmp / "spec.yaml"
    spec_file.write_text(yaml.safe_dump(doc))
    port = free_port()
    out = (tmp / "up.out").open("w")
    launcher = subprocess.Popen([*CLI, "up", "-f", str(spec_file), "--gateway", "--port", str(port),
                                 "--log-dir", str(tmp / "logs"), "--worker-arg=--num-kv-blocks=256"],
                                stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
    text = lambda: (tmp / "up.out").read_text()  # noqa: E731
    try:
        wait_for(lambda: "  -> " in text() or launcher.poll() is not None, 150, "disagg up --gateway to serve")
        assert launcher.poll() is None, text()
        yield {"launcher": launcher, "gateway": f"http://127.0.0.1:{port}", "output": text, "logs": tmp / "logs",
               "reference": reference.spec.url}
    finally:
        if launcher.poll() is None:
            launcher.send_signal(signal.SIGTERM)
            launcher.wait(60)
        out.close()


def worker_urls(up) -> dict[str, str]:
    import re

    return dict(re.findall(r"((?:prefill|decode)-\d)\s+ready\s+(http://\S+)", up["output"]()))


def test_the_gateway_serves_what_disagg_up_announces(up):
    out = up["output"]()
    assert "Envoy gateway + endpoint picker" in out
    assert f"serving tiny-llama at {up['gateway']}" in out and '"finish_reason": "length"' in out
    r = httpx.get(f"{up['gateway']}/v1/models", timeout=10)
    assert r.status_code == 200 and r.headers["server"] == "envoy", r.text
    assert r.json()["data"][0]["id"] == "tiny-llama"


@pytest.mark.parametrize("kind", ["completion", "chat"])
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_greedy_output_through_the_gateway_matches_one_colocated_worker(up, kind, stream):
    assert generate(up["gateway"], kind, stream) == generate(up["reference"], kind, False)


def test_n_and_logprobs_come_back_whole(up):
    body = {"model": "tiny-llama", "prompt": "The gateway picked a decode worker", "max_tokens": 6, "n": 2,
            "temperature": 0, "ignore_eos": True, "logprobs": 2}
    r = httpx.post(f"{up['gateway']}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert sorted(c["index"] for c in choices) == [0, 1]
    assert choices[0]["text"] == choices[1]["text"]  # greedy: both samples alike
    for c in choices:
        assert len(c["logprobs"]["tokens"]) == 6 and all(len(t) >= 1 for t in c["logprobs"]["top_logprobs"])


def test_kv_moved_from_prefill_to_decode_over_nixl(up):
    urls = worker_urls(up)
    before = metric(urls["prefill-0"], "vllm:time_to_first_token_seconds_count")
    for i in range(4):  # the picker spreads them over both decode workers
        generate(up["gateway"], "completion", False) if i % 2 else generate(up["gateway"], "chat", False)
    assert metric(urls["prefill-0"], "vllm:time_to_first_token_seconds_count") >= before + 4  # every one prefilled
    decodes = [urls["decode-0"], urls["decode-1"]]
    assert sum(metric(u, "vllm:nixl_bytes_transferred_sum") for u in decodes) > 0
    assert sum(metric(u, "disagg:kv_bytes_loaded_total") for u in decodes) > 0


def test_bad_input_is_a_400_that_names_the_field(up):
    r = httpx.post(f"{up['gateway']}/v1/completions", timeout=30,
                   json={"model": "tiny-llama", "prompt": "x", "max_tokens": "many"})
    assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"], r.text
    assert httpx.post(f"{up['gateway']}/v1/completions", content=b"{not json", timeout=30,
                      headers={"content-type": "application/json"}).status_code == 400
    assert generate(up["gateway"], "completion", False)  # and it keeps serving


def test_ctrl_c_stops_envoy_the_picker_and_every_worker(up):
    launcher = up["launcher"]
    kids = children_of(launcher.pid)
    assert len(kids) == 5, kids  # prefill, 2 decode, the endpoint picker, Envoy
    launcher.send_signal(signal.SIGINT)
    assert launcher.wait(90) == 0
    assert [pid for pid in kids if alive(pid)] == []
    assert "stopped" in up["output"]()
