"""`disagg up` with engine vllm: the router + 1 prefill + 1 decode `vllm serve` processes built by the operator's
command builder. Completions and chat, plain and streaming, through the router equal one colocated vLLM worker's
greedy output; the KV moved over NIXL (vLLM's nixl metrics on decode); SIGTERM leaves no process behind.

Scale to zero on the same set (spec.autoscaling.scaleToZero, each vLLM behind disagg pd-proxy): while the tests
above send requests the pools stay up (every request between two reads counts, though each is over before the
next read); idle for idleSeconds after them, both pools go to zero processes; then 20 concurrent requests arrive:
the router holds them, the launcher brings both vLLM workers back at once, and every request gets 200 with the
colocated reference's greedy text. The cold start (held -> first byte) is the router's histogram, printed: vLLM's
start-up is most of it.

vLLM starts in about a minute here and its NIXL progress thread takes a core per idle worker, so the colocated
reference runs first and alone, and the P/D set only as long as its tests need it."""
from __future__ import annotations

import concurrent.futures
import functools
import signal
import time

import httpx
import pytest
import waiting
from serving_helpers import metric_sum
from vllm_env import KINDS, MODEL, disagg_up, generate
from vllm_fleet import ENGINE_ARGS, STARTUP_S, pd_spec  # noqa: F401 (re-exported)

from disagg.worker.local.process import free_port

wait_for = functools.partial(waiting.wait_for, interval=0.5)


def vllm_spec(model_dir: str, decode_replicas: int = 1, grace_s: int = 30) -> dict:
    """grace_s: with the 60 s lease it leaves vLLM's --shutdown-timeout at 1 s (90: 25 s). vLLM 0.32's CPU worker
    process does not exit by itself when its engine stops, so an idle vLLM always takes the whole timeout to stop
    (then it is killed): 25 s for each teardown of a set whose tests leave no request running."""
    spec = pd_spec(model_dir, MODEL)
    spec["prefill"]["terminationGracePeriodSeconds"] = grace_s
    spec["decode"].update(replicas=decode_replicas, terminationGracePeriodSeconds=grace_s)
    return {"apiVersion": "disagg.dev/v1alpha1", "kind": "DisaggregatedInference", "metadata": {"name": "vllm-up"},
            "spec": spec}


IDLE_S = 20  # longer than any pause between this module's requests, on a loaded 2-core box


def zero_spec(model_dir: str) -> dict:
    doc = vllm_spec(model_dir)
    one = {"minReplicas": 1, "maxReplicas": 1}
    doc["spec"]["autoscaling"] = {
        "enabled": True, "intervalSeconds": 2, "prefill": one, "decode": one,
        # the hold outlasts two vLLM start-ups on a loaded 2-core box
        "scaleToZero": {"enabled": True, "idleSeconds": IDLE_S, "holdSeconds": 420, "maxHeldRequests": 50}}
    return doc


@pytest.fixture(scope="module")
def up(vllm_executable, vllm_model_dir, reference_texts, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vllm-up")
    port, status_port = free_port(), free_port()
    # "  -> ": disagg up's own first request is over before the tests begin
    with disagg_up(zero_spec(vllm_model_dir), tmp, vllm_executable, port, STARTUP_S, "  -> ",
                   ["--status-port", str(status_port)]) as up:
        yield {**up, "router": f"http://127.0.0.1:{port}", "status": f"http://127.0.0.1:{status_port}"}


def _status(up: dict) -> dict:
    return httpx.get(f"{up['status']}/status", timeout=30).json()


def test_disagg_up_starts_vllm_serve_from_the_builder(up):
    out = up["output"]()
    assert "engine vllm" in out and "prefill-0" in out and "decode-0" in out, out
    # a vLLM on a starved 2-core box may take longer than httpx's default 5 s to answer what the router forwards
    assert httpx.get(f"{up['status']}/ready", timeout=60).status_code == 200
    assert httpx.get(f"{up['router']}/v1/models", timeout=60).json()["data"][0]["id"] == MODEL
    prefill_log = (up["logs"] / "prefill-0.log").read_text()
    assert "kv_producer" in prefill_log or "NixlConnector" in prefill_log
    # the router found no /ready on vLLM and probes /health: both workers count as ready
    assert httpx.get(f"{up['router']}/ready", timeout=60).json() == {"ready": True, "decode_ready": 1,
                                                                     "prefill_ready": 1}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_pd_through_the_router_equals_one_colocated_vllm(up, reference_texts, kind, stream):
    assert generate(up["router"], kind, stream) == reference_texts[kind]


def test_kv_moved_over_nixl(up):
    """This request's KV came over NIXL. (Counted per request: a first handshake can time out on a starved
    2-core box - vLLM waits 5 s for the prefill's side channel - and vLLM then recomputes; seen once.)"""
    decode, prefill = up["urls"]["decode-0"], up["urls"]["prefill-0"]
    before = {name: metric_sum(decode, name) for name in
              ("vllm:nixl_xfer_time_seconds_count", "vllm:nixl_num_failed_transfers_total")}
    generate(up["router"], "completion", False)
    wait_for(lambda: metric_sum(decode, "vllm:nixl_xfer_time_seconds_count")
             > before["vllm:nixl_xfer_time_seconds_count"], 30, "this request's READ in vLLM's NIXL metrics")
    assert metric_sum(decode, "vllm:nixl_bytes_transferred_sum") > 0
    assert metric_sum(decode, "vllm:nixl_num_failed_transfers_total") == before["vllm:nixl_num_failed_transfers_total"]
    # decode took the prompt's KV from prefill rather than computing it
    assert metric_sum(decode, 'vllm:prompt_tokens_by_source_total{engine="0",model_name="' + MODEL
                      + '",source="external_kv_transfer"}') > 0
    assert metric_sum(prefill, "vllm:prompt_tokens_total") > 0


def test_the_autoscaler_decides_from_live_vllm_metrics(up):
    """The operator's scrape and policy on vLLM's own /metrics: the signals vLLM has (waiting requests, KV usage,
    TTFT, ITL, NIXL transfer time and failures, requests waiting for remote KV by stage) are measured; at this
    light load nothing scales. vLLM has no disagg:kv_pending_sends: the decision names it unavailable, not 0."""
    from disagg.operator.autoscaling.inputs import policy_from_spec
    from disagg.operator.autoscaling.policy import ScalingHistory, decide
    from disagg.operator.autoscaling.sources import scrape_pods
    from disagg.operator.spec import AutoscalingSpec

    policy = policy_from_spec(AutoscalingSpec.model_validate(
        {"enabled": True, "targets": {"transfer": {"kvTransferTimeMilliseconds": 60000}}}))
    targets = [(f"{up['urls'][name]}/metrics", name, name.split("-")[0]) for name in ("prefill-0", "decode-0")]

    def decide_now(history: ScalingHistory):
        samples = scrape_pods(targets, timeout=30)
        assert [s.error for s in samples] == [None, None]
        by_role = {role: [s for s in samples if s.role == role] for role in ("prefill", "decode")}
        return decide(by_role, {"prefill": 1, "decode": 1}, policy, history, time.time())

    first = decide_now(ScalingHistory())
    generate(up["router"], "completion", True)  # traffic inside the window: latency histograms move
    second = decide_now(first.history)
    m = second.metrics
    for name in ("prefill_waiting_requests_per_pod", "decode_kv_cache_usage", "prefill_ttft_seconds",
                 "decode_itl_seconds", "xfer_time_seconds", "failed_transfers"):
        assert m[name] is not None, (name, m)
    assert 0 <= m["decode_kv_cache_usage"] <= 1 and m["failed_transfers"] == 0
    assert {r: (d.current, d.desired) for r, d in second.roles.items()} == {"prefill": (1, 1), "decode": (1, 1)}, \
        (second.roles, m, second.conditions)
    assert "pendingSends" in second.signals["prefill"]["unavailable"] and m["prefill_pending_sends_per_pod"] is None
    assert "pendingLoads" in second.signals["decode"]["used"]  # vllm:num_requests_kv_fetch_by_stage


def test_idle_pools_go_to_zero_and_twenty_requests_bring_them_back_with_the_same_text(up, reference_texts):
    router, text = up["router"], up["output"]
    assert "ScaledToZero" not in text(), f"the pools went to zero while the tests above sent requests\n{text()}"
    wait_for(lambda: _status(up)["replicas"] == {"prefill": 0, "decode": 0}, IDLE_S + 100, f"scale to zero\n{text()}")
    wait_for(lambda: _status(up)["workers"] == [], 180, f"the vLLM workers to drain and stop\n{text()}")
    assert _status(up)["autoscaling"]["scaleToZero"]["atZero"]
    assert httpx.get(f"{router}/ready", timeout=10).status_code == 200  # it holds: reachable at zero

    t0 = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(20) as pool:
        texts = list(pool.map(lambda _: generate(router, "completion", False), range(20)))
    took = time.monotonic() - t0
    assert texts == [reference_texts["completion"]] * 20
    assert _status(up)["replicas"] == {"prefill": 1, "decode": 1}
    assert "prefill 0 -> 1 (ScaledFromZero)" in text() and "decode 0 -> 1 (ScaledFromZero)" in text()
    held = metric_sum(router, "disagg:router_cold_start_seconds_count")
    cold = metric_sum(router, "disagg:router_cold_start_seconds_sum") / held
    assert held == 20 and metric_sum(router, "disagg:router_held_requests") == 0
    print(f"\nvLLM: 20 requests at zero served in {took:.1f}s; cold start (held -> first byte) mean {cold:.1f}s")


def test_sigterm_stops_every_vllm_process(up):
    workers = [w["url"] for w in _status(up)["workers"]]  # those running now (scale to zero restarted them)
    launcher = up["launcher"]
    launcher.send_signal(signal.SIGTERM)
    assert launcher.wait(180) == 0
    for url in (*workers, up["router"]):
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"{url}/health", timeout=2)
    assert "stopped" in up["output"]()
