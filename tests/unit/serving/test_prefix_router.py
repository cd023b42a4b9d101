"""The prefix-aware adapter: the router tokenizes a request exactly as the worker does (completion text, token
ids, chat through the template) and hashes it as the engine does, so an endpoint's announced blocks match."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from disagg.worker.engine.kv_cache_manager import KVCacheManager
from disagg.worker.engine.request import Request
from disagg.worker.sampling_params import SamplingParams
from disagg.worker.kv_events.collector import KVEventCollector
from disagg.worker.model.tokenizer import Tokenizer
from disagg.worker.router.endpoints import EndpointPool
from disagg.worker.router.metrics import RouterMetrics
from disagg.worker.router.prefix_policy import PrefixPolicyConfig
from disagg.worker.router.prefix_router import PrefixRouter
from disagg.worker.server.admission import prompt_token_ids as _prompt_token_ids
from disagg.worker.server.protocol import ChatCompletionRequest, CompletionRequest

TEXT = "the history of the city begins with a small harbour and a market where fishermen sold fish " * 4
BODIES = {
    "completion text": ("/v1/completions", {"prompt": TEXT}),
    "completion ids": ("/v1/completions", {"prompt": list(range(40))}),
    "chat": ("/v1/chat/completions", {"messages": [{"role": "system", "content": TEXT},
                                                   {"role": "user", "content": "hello"}]}),
    "chat with parts": ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": TEXT}]}], "add_generation_prompt": False}),
}


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return Tokenizer(tiny_model_dir)


@pytest.mark.parametrize("path, body", BODIES.values(), ids=BODIES.keys())
def test_router_tokenizes_as_the_worker(tok, path, body):
    router = PrefixRouter(PrefixPolicyConfig(), RouterMetrics(), tok)
    model = ChatCompletionRequest if "chat" in path else CompletionRequest
    want = _prompt_token_ids(SimpleNamespace(tokenizer=tok), model.model_validate(body))
    assert router.prompt_token_ids(body, path) == want


def test_without_tokenizer_or_with_a_bad_request_there_is_no_plan(tok):
    pools = EndpointPool("prefill", "prefix-aware"), EndpointPool("decode", "prefix-aware")
    assert PrefixRouter(PrefixPolicyConfig(), RouterMetrics()).plan({"prompt": "x"}, "/v1/completions", *pools) is None
    router = PrefixRouter(PrefixPolicyConfig(), RouterMetrics(), tok)
    assert router.plan({"prompt": 5}, "/v1/completions", *pools) is None


def test_plan_finds_the_blocks_an_engine_announced(tok):
    body = {"prompt": TEXT}
    ids = tok.encode(TEXT)
    # a real engine-side pool caches the prompt and reports it, as the worker would publish it
    collector = KVEventCollector(16)
    kv = KVCacheManager(64, 16, events=collector)
    req = Request("r", ids, SamplingParams(), frozenset())
    kv.allocate_slots(req, len(ids))
    kv.cache_blocks(req, len(ids))
    metrics = RouterMetrics()
    router = PrefixRouter(PrefixPolicyConfig(skip_prefill_max_missing_blocks=0), metrics, tok)
    router.index.apply("http://b", 0, collector.take().events)
    prefill, decode = EndpointPool("prefill", "prefix-aware"), EndpointPool("decode", "prefix-aware")
    decode.set_urls(["http://a", "http://b"])
    prefill.set_urls(["http://p"])
    for ep in [*decode.endpoints.values(), *prefill.endpoints.values()]:
        ep.ready = True
    plan = router.plan(body, "/v1/completions", prefill, decode)
    full = (len(ids) - 1) // 16
    assert plan.decode_url == "http://b" and plan.decode_hit_tokens == full * 16 and plan.skip_prefill
    assert decode.pick(costs=plan.decode_costs).url == "http://b"
    text = metrics.render().decode()
    assert f'disagg:router_prefix_hit_tokens_total{{model_name="",role="router"}} {float(full * 16)}' in text
    # the same prompt with a different first token shares no block
    other = router.plan({"prompt": "Once " + TEXT}, "/v1/completions", prefill, decode)
    assert other.decode_hit_tokens == 0 and not other.skip_prefill


# ---------------------------------------------------------------- vLLM workers: POST /tokenize, events by directory
TOKENIZE_CASES = {
    "completion text": ({"model": "m", "prompt": "hi"}, "/v1/completions", {"model": "m", "prompt": "hi"}),
    "special tokens as asked": ({"prompt": "hi", "add_special_tokens": False}, "/v1/completions",
                                {"prompt": "hi", "add_special_tokens": False}),
    "a batch of one": ({"prompt": ["hi"]}, "/v1/completions", {"prompt": "hi"}),
    "token ids need no call": ({"prompt": [1, 2, 3]}, "/v1/completions", [1, 2, 3]),
    "a batch: not told": ({"prompt": ["a", "b"]}, "/v1/completions", None),
    "chat: the template's inputs": ({"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 3,
                                     "add_generation_prompt": False, "chat_template_kwargs": {"k": 1}},
                                    "/v1/chat/completions",
                                    {"model": "m", "messages": [{"role": "user", "content": "x"}],
                                     "add_generation_prompt": False, "chat_template_kwargs": {"k": 1}}),
    "chat without messages": ({"messages": "x"}, "/v1/chat/completions", None),
}


@pytest.mark.parametrize("body, path, want", TOKENIZE_CASES.values(), ids=TOKENIZE_CASES.keys())
def test_vllm_tokenize_body(body, path, want):
    from disagg.worker.router.prefix_router import tokenize_body

    assert tokenize_body(body, path) == want


def test_events_directory_prefers_the_announced_entry_then_the_fixed_ports():
    from disagg.worker.router.discovery import parse_kv_events
    from disagg.worker.kv_events.subscriber import EventsDirectory

    announced = parse_kv_events('{"decode": ["http://a:1"], "kv_events": {"http://a:1": {"endpoint": '
                                '"tcp://a:7", "topic": "t"}, "http://b:1": {"endpoint": 5}}}')
    assert announced == {"http://a:1": {"endpoint": "tcp://a:7", "topic": "t"}}
    d = EventsDirectory(5557, 5558, "kv-events", announced.get)
    assert d.info("http://a:1") == {"endpoint": "tcp://a:7", "topic": "t"}
    assert d.info("http://10.0.0.9:8000") == {"endpoint": "tcp://10.0.0.9:5557",
                                              "replay_endpoint": "tcp://10.0.0.9:5558", "topic": "kv-events"}
    assert EventsDirectory().info("http://10.0.0.9:8000") is None


def test_the_endpoints_file_carries_where_each_worker_publishes(tmp_path):
    """disagg up writes each vLLM worker's event ports next to its URL; the router's file discovery reads them."""
    from disagg.worker.router.discovery import FileDiscovery, write_endpoints

    path = tmp_path / "endpoints.json"
    info = {"endpoint": "tcp://127.0.0.1:7001", "replay_endpoint": "tcp://127.0.0.1:7002", "topic": "kv-events"}
    write_endpoints(path, [], ["http://127.0.0.1:1"], {"http://127.0.0.1:1": info})
    discovery = FileDiscovery(str(path))
    prefill, decode = EndpointPool("prefill", "prefix-aware"), EndpointPool("decode", "prefix-aware")
    assert discovery.poll(prefill, decode) and list(decode.endpoints) == ["http://127.0.0.1:1"]
    assert discovery.kv_events == {"http://127.0.0.1:1": info}
    write_endpoints(path, [], ["http://127.0.0.1:1", "http://127.0.0.1:2"])  # no events announced any more
    discovery.poll(prefill, decode)
    assert discovery.kv_events == {}
