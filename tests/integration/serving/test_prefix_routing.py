"""Prefix-aware routing against real processes: two decode workers publishing KV-cache events, a router with
--policy prefix-aware. A prompt sent again goes where its prefix is cached (that worker's prefix-cache hits
rise); after that worker restarts, the router no longer predicts a hit there."""
from __future__ import annotations

import time

import httpx
import pytest
from conftest import Fleet
from serving_helpers import metric

from disagg.worker.local.process import free_port

pytestmark = pytest.mark.slow

# ~6 full blocks of 16 tokens with the tiny model's tokenizer
PROMPT = ("The history of the city begins with a small harbour and a market where fishermen sold the morning "
          "catch to merchants from the hills, and the merchants carried salt and wool back over the passes "
          "before the first snow closed them for the winter")


def events_flags() -> tuple[str, ...]:
    return ("--kv-events-endpoint", f"tcp://127.0.0.1:{free_port()}",
            "--kv-events-replay-endpoint", f"tcp://127.0.0.1:{free_port()}")


def wait_for(predicate, what: str, fleet: Fleet, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}:\n{fleet.procs['router'].log_tail(30)}"
        time.sleep(0.2)


def counter(url: str, name: str) -> float:
    """A labelled counter's value; 0 before its first increment (no sample yet)."""
    for line in httpx.get(f"{url}/metrics", timeout=5).text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def send(router: str) -> None:
    r = httpx.post(f"{router}/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "temperature": 0},
                   timeout=60)
    assert r.status_code == 200, r.text


def queries(url: str) -> float:
    return metric(url, "vllm:prefix_cache_queries_total")


@pytest.fixture
def fleet(tmp_path, tiny_model_dir):
    fleet = Fleet(tmp_path)
    ports = [free_port(), free_port()]
    flags = [events_flags(), events_flags()]
    decodes = [fleet.worker(f"decode-{i}", "decode", tiny_model_dir, None, extra=flags[i], port=ports[i])
               for i in range(2)]
    fleet.wait_ready()
    router = fleet.router([], decodes, extra=("--policy", "prefix-aware"))
    fleet.wait_ready()
    yield {"fleet": fleet, "router": router, "decodes": decodes, "flags": flags, "ports": ports,
           "model": tiny_model_dir}
    codes = fleet.stop()
    assert all(c == 0 for c in codes.values()), codes


def test_repeated_prompt_lands_where_its_prefix_is_and_a_restart_forgets_it(fleet):
    router, decodes = fleet["router"], fleet["decodes"]
    # both subscriptions caught up: each worker's first batch is an AllBlocksCleared
    wait_for(lambda: counter(router, "disagg:router_kv_events_total") >= 2, "the router's subscriptions", fleet["fleet"])
    send(router)
    first = [queries(u) for u in decodes]
    owner = 0 if first[0] > first[1] else 1
    assert first[1 - owner] == 0, first
    wait_for(lambda: counter(router, "disagg:router_kv_events_total") >= 3, "the stored blocks' event", fleet["fleet"])

    hits_before = metric(decodes[owner], "vllm:prefix_cache_hits_total")
    for _ in range(3):  # a rotating policy would alternate
        send(router)
    assert queries(decodes[1 - owner]) == 0, "a repeated prompt went to the worker without its prefix"
    assert metric(decodes[owner], "vllm:prefix_cache_hits_total") >= hits_before + 3 * 5 * 16
    predicted = counter(router, "disagg:router_prefix_hit_tokens_total")
    assert predicted >= 3 * 5 * 16

    # restart the owner on the same ports: its cache is empty, and the router must not predict a hit there
    f = fleet["fleet"]
    proc = f.procs.pop(f"decode-{owner}")
    proc.terminate()
    assert proc.popen.wait(30) == 0
    f.worker(f"decode-{owner}", "decode", fleet["model"], None, extra=fleet["flags"][owner],
             port=fleet["ports"][owner])
    f.wait_ready()
    wait_for(lambda: httpx.get(f"{router}/endpoints", timeout=5).json()["decode"][owner]["ready"],
             "the router to see the restarted worker", f)
    send(router)
    assert counter(router, "disagg:router_prefix_hit_tokens_total") == predicted, "a hit predicted after restart"
