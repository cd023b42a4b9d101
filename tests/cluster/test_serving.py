"""Scenario a: `kubectl apply` of a CR -> the operator's prefill, decode and router pods run as processes on their
own pod IPs -> the CR reports Ready -> OpenAI completions (plain and streaming) and chat completions through the
router pod, with the prompt's KV moved from the prefill pod to the decode pod over NIXL.
Scenario e: deleting the CR ends every pod process and garbage-collects every child."""
from __future__ import annotations

import json
import time

import httpx
import pytest
from serving_helpers import NIXL_MISSING, metric, nixl_available

from scenario import MODEL, PROMPT, component, cr_manifest, delete_and_wait, live_pods, pod_url, router_url, \
    wait_ready, wait_router_pairs

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not nixl_available(), reason=NIXL_MISSING)]
NAME = "serve"


def test_cr_serves_openai_completions_through_the_router_pod_and_deleting_it_ends_every_process(cluster, checkpoint):
    t0 = time.monotonic()
    cluster.apply(cr_manifest(NAME, checkpoint))
    cr = wait_ready(cluster, NAME)
    t_ready = time.monotonic() - t0
    assert cr["status"]["prefill"]["readyReplicas"] == cr["status"]["decode"]["readyReplicas"] == 1
    pods = {role: live_pods(cluster, NAME, role) for role in ("prefill", "decode", "router")}
    assert all(len(p) == 1 for p in pods.values()), pods
    ips = {p[0]["status"]["podIP"] for p in pods.values()}
    assert len(ips) == 3 and all(ip.startswith("127.") and ip != "127.0.0.1" for ip in ips), ips
    # the downward API gave each worker its pod IP: the NIXL side channel advertises it
    prefill_ip = pods["prefill"][0]["status"]["podIP"]
    log = (cluster.log_dir / f"default_{pods['prefill'][0]['metadata']['name']}_prefill.log").read_text()
    assert f"side channel {prefill_ip}:5600" in log, log[-2000:]

    wait_router_pairs(cluster, NAME)  # else the first requests may go decode-alone (correct, but no KV moves)
    router = router_url(cluster, NAME)
    with httpx.Client(timeout=60) as http:
        # plain completion
        r = http.post(f"{router}/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 8,
                                                        "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["choices"][0]["finish_reason"] == "length" and body["usage"]["completion_tokens"] == 8, body
        # streaming: SSE chunks, then [DONE]; the streamed text is the plain one (greedy)
        with http.stream("POST", f"{router}/v1/completions",
                         json={"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
                               "ignore_eos": True, "stream": True}) as s:
            assert s.status_code == 200 and s.headers["content-type"].startswith("text/event-stream")
            lines = [line for line in s.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]", lines
        chunks = [json.loads(line[len("data: "):]) for line in lines[:-1]]
        assert "".join(c["choices"][0]["text"] for c in chunks) == body["choices"][0]["text"]
        # chat
        r = http.post(f"{router}/v1/chat/completions",
                      json={"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 8,
                            "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["role"] == "assistant"
    # both hops ran on their pods, and decode READ the prompt's KV from prefill
    assert metric(pod_url(pods["prefill"][0]), "vllm:prompt_tokens_total") > 0
    decode = pod_url(pods["decode"][0])
    assert metric(decode, "vllm:generation_tokens_total") >= 24
    assert metric(decode, "vllm:nixl_bytes_transferred_sum") > 0

    # e: delete the CR -> pods terminate (preStop, SIGTERM) -> processes end -> the children are collected
    t_delete = delete_and_wait(cluster, NAME)
    assert not cluster.pods(component(NAME, "router"))
    print(f"\nscenario a: Ready after {t_ready:.1f}s; e: everything gone {t_delete:.1f}s after the delete")
