"""The decode worker's KV cache exhausted under load: 1 prefill + 1 decode (SharedStorageConnector) behind the
router, the decode's cache 32 blocks (512 tokens) while 12 concurrent requests want ~14 blocks each as they
grow. The engine preempts (and recomputes) rather than fail: every request ends in a whole 200 or a 429 with
Retry-After - never a 5xx or a stream cut short - preemptions are counted, and afterwards KV usage is back to 0."""
from __future__ import annotations

import collections
import concurrent.futures
import time

import pytest

from ctl_fixtures import gauges, router_counter, wait_idle
from overload_fixtures import body, pd_fleet, read_stream

pytestmark = pytest.mark.slow

WORKER_FLAGS = ["--host", "127.0.0.1", "--dtype", "float32", "--max-model-len", "512", "--served-model-name",
                "tiny-llama", "--max-num-seqs", "16"]
DECODE_BLOCKS = 32  # x 16 tokens
CONCURRENT, MAX_TOKENS = 12, 200
SLACK_S = 30.0


@pytest.fixture(scope="module")
def pd(tiny_model_dir, tmp_path_factory):
    with pd_fleet(tmp_path_factory.mktemp("kv-exhausted"), tiny_model_dir, WORKER_FLAGS,
                  prefill_extra=("--num-kv-blocks", "256"), decode_extra=("--num-kv-blocks", str(DECODE_BLOCKS))) as pd:
        yield pd


def test_an_exhausted_kv_cache_preempts_or_sheds_and_never_fails_a_request(pd, record_outcome):
    router, decode = pd["router"], pd["decode"]
    preempted = router_counter(decode, "vllm:num_preemptions_total")
    started = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(CONCURRENT) as pool:
        ends = list(pool.map(lambda i: read_stream(router, body(MAX_TOKENS, stream=bool(i % 2))),
                             range(CONCURRENT)))
    took = time.monotonic() - started
    kinds = collections.Counter((e.kind, e.status) for e in ends)
    print(f"OUTCOME KV exhausted: {dict(kinds)} in {took:.1f} s")
    for e in ends:
        if e.kind == "status":
            assert e.status == 429, e
        else:
            assert e.kind == "whole" and e.tokens == MAX_TOKENS, e
    assert router_counter(decode, "vllm:num_preemptions_total") > preempted, "the cache never ran out"
    wait_idle(pd["workers"])
    assert gauges(decode)["vllm:kv_cache_usage_perc"] == 0
    record_outcome("decode KV cache exhausted under load", f"{dict(kinds)}, preempted", took, SLACK_S)
    assert took < SLACK_S
