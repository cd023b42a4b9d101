"""Prefix-aware routing in front of vLLM workers: `disagg up` with engine vllm, 2 decode workers (no prefill hop)
and router.policy prefix-aware. vLLM publishes its KV-cache events (--kv-events-config from the operator's
builder), the router learns where from the endpoints file, translates vLLM's block hashes to its own and
tokenizes each prompt by a worker's POST /tokenize. A prompt sent again lands on the worker that served it the
first time, which then counts prefix-cache hits; the router's own hit metric says it predicted them."""
from __future__ import annotations

import functools

import httpx
import pytest
import waiting
from vllm_env import ENGINE_ENV, disagg_up

from serving_helpers import metric_sum

MODEL = "tiny-vllm"
STARTUP_S = 500  # two vLLM processes starting on two busy cores
wait_for = functools.partial(waiting.wait_for, interval=0.5)
WORDS = "the engineers measured latency of every request twice and wrote it down in a book".split()
# two prompts of ~4 blocks (block size 32: the CPU attention takes multiples of 32) that share nothing from their first token on
PROMPTS = {"a": " ".join(WORDS * 10), "b": " ".join(reversed(WORDS * 10)),
           "chat": [{"role": "system", "content": " ".join(WORDS[3:] * 10)}, {"role": "user", "content": "why"}]}


def prefix_spec(model_dir: str) -> dict:
    env = [{"name": k, "value": v} for k, v in ENGINE_ENV.items()]
    return {"apiVersion": "disagg.dev/v1alpha1", "kind": "DisaggregatedInference", "metadata": {"name": "vllm-prefix"},
            "spec": {"engine": "vllm", "engineArgs": ["--enforce-eager", "--max-num-seqs", "8", "--block-size", "32"],
                     "model": {"servedName": MODEL, "source": {"path": model_dir}, "dtype": "float32",
                               "maxModelLen": 512},
                     "kvTransfer": {"connector": "NixlConnector", "leaseSeconds": 60},
                     "prefill": {"replicas": 0, "env": env},
                     "decode": {"replicas": 2, "env": env},
                     "router": {"policy": "prefix-aware"}}}


@pytest.fixture(scope="module")
def up(vllm_executable, vllm_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vllm-prefix")
    port = free_port()
    # "  -> ": disagg up's own first request is answered (else it would count on a worker during the test)
    with disagg_up(prefix_spec(vllm_model_dir), tmp, vllm_executable, port, STARTUP_S, "  -> ") as up:
        yield {"router": f"http://127.0.0.1:{port}", "urls": up["urls"], "logs": up["logs"]}


def free_port() -> int:
    from disagg.worker.local.process import free_port as free

    return free()


def router_counter(url: str, name: str) -> float:
    """A router counter's total (a labelled counter with no sample yet is not rendered: 0)."""
    lines = httpx.get(f"{url}/metrics", timeout=10).text.splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith((name + "{", name + " ")))


def post(router: str, prompt: str | list) -> None:
    """A completion (text) or a chat (messages: tokenized by vLLM's chat template, via its POST /tokenize)."""
    chat = isinstance(prompt, list)
    body = {"model": MODEL, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
            **({"messages": prompt} if chat else {"prompt": prompt})}
    r = httpx.post(f"{router}/v1/{'chat/' if chat else ''}completions", json=body, timeout=300)
    assert r.status_code == 200, r.text


def served(decodes: list[str]) -> dict[str, float]:
    return {url: metric_sum(url, "vllm:request_success_total") for url in decodes}


def test_a_repeated_prompt_goes_where_vllm_cached_it(up):
    decodes = [up["urls"]["decode-0"], up["urls"]["decode-1"]]
    router = up["router"]
    first_worker = {}
    for name, prompt in PROMPTS.items():
        before, events = served(decodes), router_counter(router, "disagg:router_kv_events_total")
        post(router, prompt)
        after = served(decodes)
        (first_worker[name],) = [u for u in decodes if after[u] > before[u]]
        # the router indexed what vLLM stored (its events arrive a moment after the answer)
        wait_for(lambda: router_counter(router, "disagg:router_kv_events_total") > events, 60, "the KV events")
    for name, prompt in PROMPTS.items():
        before = served(decodes)
        hits = {u: metric_sum(u, "vllm:prefix_cache_hits_total") for u in decodes}
        predicted = router_counter(router, "disagg:router_prefix_hit_tokens_total")
        post(router, prompt)
        after = served(decodes)
        assert [u for u in decodes if after[u] > before[u]] == [first_worker[name]], (name, first_worker)
        assert metric_sum(first_worker[name], "vllm:prefix_cache_hits_total") > hits[first_worker[name]]
        # the router predicted the hit: at least the prompt's full blocks but the last (block size 32)
        assert router_counter(router, "disagg:router_prefix_hit_tokens_total") - predicted >= 32 * 3
    assert "tokenized by the workers' POST /tokenize" in (up["logs"] / "router.log").read_text()
