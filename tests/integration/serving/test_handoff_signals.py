"""The router's engine-agnostic KV-transfer signals (what the autoscaler reads for vLLM pods) agree with our
worker's own gauges: a hand-off held at the prefill while its decode is frozen reads 1 pending send on both
sides and 1 pending load at the router; once the decode thaws and answers, both read 0 again."""
from __future__ import annotations

import signal
import threading

import httpx
import pytest
from serving_fleet import Fleet, signal_group
from serving_helpers import NIXL_MISSING, nixl_available
from waiting import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not nixl_available(), reason=NIXL_MISSING)]


def gauge(url: str, name: str, endpoint: str | None = None) -> float:
    total = 0.0
    for line in httpx.get(f"{url}/metrics", timeout=5).text.splitlines():
        if line.startswith(name + "{") and (endpoint is None or f'endpoint="{endpoint}"' in line):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_pending_sends_and_loads_at_the_router_agree_with_the_workers(tiny_model_dir, tmp_path):
    fleet = Fleet(tmp_path)
    prefill = fleet.worker("prefill", "prefill", tiny_model_dir, "NixlConnector", lease_s=20)
    decode = fleet.worker("decode", "decode", tiny_model_dir, "NixlConnector")
    fleet.wait_ready()
    router = fleet.router([prefill], [decode], extra=("--unresponsive-after", "0"))
    fleet.wait_ready()
    try:
        signal_group(fleet.procs["decode"], signal.SIGSTOP)
        answer: dict = {}
        client = threading.Thread(target=lambda: answer.setdefault("r", httpx.post(
            f"{router}/v1/completions", json={"model": "tiny-llama", "prompt": "the frozen decode waits",
                                             "max_tokens": 4, "temperature": 0}, timeout=60)))
        client.start()
        wait_for(lambda: gauge(router, "disagg:router_kv_pending_loads", decode) == 1, 30, "the router's pending load")
        assert gauge(router, "disagg:router_kv_pending_sends", prefill) == 1
        assert gauge(prefill, "disagg:kv_pending_sends") == 1  # the worker's own gauge agrees
        assert gauge(router, "disagg:router_kv_oldest_pending_send_seconds", prefill) > 0
        signal_group(fleet.procs["decode"], signal.SIGCONT)
        client.join(60)
        assert answer["r"].status_code == 200, answer["r"].text
        wait_for(lambda: gauge(prefill, "disagg:kv_pending_sends") == 0, 10, "the prefill's send to end")
        assert gauge(router, "disagg:router_kv_pending_sends", prefill) == 0
        assert gauge(router, "disagg:router_kv_pending_loads", decode) == 0
        assert gauge(router, "disagg:router_handoff_to_first_token_seconds_count") == 1
    finally:
        signal_group(fleet.procs["decode"], signal.SIGCONT)
        assert fleet.stop() == {"prefill": 0, "decode": 0, "router": 0}


def test_a_hand_off_the_decode_refuses_is_freed_at_its_prefill_at_once_not_at_its_lease(tiny_model_dir, tmp_path):
    """The decode worker belongs to another resource (another hand-off key): it refuses the prefill's hand-off
    (403 naming kv_transfer_params.disagg_signature) and computes the prompt itself. Nobody will read that KV, so
    the router asks the prefill to free it: the prefill's pending send ends within seconds, not at its 30 s lease,
    and a request whose decode hop froze keeps its KV (that decode may be reading it)."""
    from disagg.worker.kv_transfer.handoff_auth import KEY_ENV, RESOURCE_ENV, new_key

    fleet = Fleet(tmp_path)
    prefill = fleet.worker("prefill", "prefill", tiny_model_dir, "NixlConnector", lease_s=30,
                           env={KEY_ENV: new_key(), RESOURCE_ENV: "team-a/llama"})
    decode = fleet.worker("decode", "decode", tiny_model_dir, "NixlConnector",
                          env={KEY_ENV: new_key(), RESOURCE_ENV: "team-a/llama"})
    fleet.wait_ready()
    router = fleet.router([prefill], [decode])
    fleet.wait_ready()
    try:
        for n in range(3):
            r = httpx.post(f"{router}/v1/completions", json={"model": "tiny-llama", "prompt": f"refused {n} times",
                                                            "max_tokens": 4, "temperature": 0}, timeout=60)
            assert r.status_code == 200, r.text
        assert gauge(router, "disagg:router_decode_alone_total") == 3
        wait_for(lambda: gauge(prefill, "disagg:kv_pending_sends") == 0, 5, "the prefill to free the refused KV")
        assert gauge(prefill, "disagg:kv_released_unread_total") == 3
        assert gauge(prefill, "vllm:nixl_num_kv_expired_reqs_total") == 0  # freed by the release, not the lease
        assert gauge(router, "disagg:router_kv_pending_sends", prefill) == 0
        assert gauge(router, "disagg:router_kv_releases_total") == 3
        assert gauge(prefill, "vllm:kv_cache_usage_perc") == 0
    finally:
        assert fleet.stop() == {"prefill": 0, "decode": 0, "router": 0}
