"""CUDA paths: the model runner on a GPU and NIXL VRAM registration. Skipped without CUDA."""
from __future__ import annotations

import pytest
import torch

from disagg.worker import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
PROMPTS = ["The quick brown fox", "In a distant galaxy, long ago", "hi"]


def test_cuda_engine_matches_cpu_engine(tiny_model_dir):
    cpu = LLM(tiny_model_dir, device="cpu", max_model_len=256, num_kv_blocks=64)
    gpu = LLM(tiny_model_dir, device="cuda", max_model_len=256, num_kv_blocks=64)
    assert gpu.engine.runner.kv_cache.is_cuda
    want = [o.outputs[0].token_ids for o in cpu.generate(PROMPTS, GREEDY)]
    got = [o.outputs[0].token_ids for o in gpu.generate(PROMPTS, GREEDY)]
    assert got == want
    assert gpu.engine.kv_cache_manager.num_free_blocks == 64


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_cuda_half_precision_runs(tiny_model_dir, dtype):
    llm = LLM(tiny_model_dir, device="cuda", dtype=dtype, max_model_len=256, num_kv_blocks=64)
    out = llm.generate(PROMPTS, GREEDY)
    assert all(len(o.outputs[0].token_ids) == 12 for o in out)


def test_nixl_vram_registration_and_transfer(tiny_model_dir):
    pytest.importorskip("nixl")
    import threading
    import time

    ktc = {"kv_connector": "NixlConnector"}
    prefill = LLM(tiny_model_dir, device="cuda", max_model_len=256, num_kv_blocks=64, kv_transfer_config=ktc)
    decode = LLM(tiny_model_dir, device="cuda", max_model_len=256, num_kv_blocks=64, kv_transfer_config=ktc)
    assert prefill.engine.worker_connector.transport.device_kind == "VRAM"
    reference = [o.outputs[0].token_ids for o in LLM(tiny_model_dir, device="cuda", max_model_len=256,
                                                     num_kv_blocks=64).generate(PROMPTS, GREEDY)]
    pe = prefill.engine
    ids = [pe.add_request(p, SamplingParams(max_tokens=1, temperature=0), kv_transfer_params={"do_remote_decode": True})
           for p in PROMPTS]
    params = {}
    while len(params) < len(ids):
        for o in pe.step():
            if o.finished:
                params[o.request_id] = o.kv_transfer_params
    stop = threading.Event()

    def pump():
        while not stop.is_set():
            pe.step()
            time.sleep(0.001)

    t = threading.Thread(target=pump)
    t.start()
    try:
        outs = decode.generate(PROMPTS, GREEDY, kv_transfer_params=[params[i] for i in ids])
    finally:
        stop.set()
        t.join()
    assert [o.outputs[0].token_ids for o in outs] == reference
    stats = decode.engine.stats.kv_connector_stats
    assert sum(sum(s["bytes"]) for s in stats) > 0
    prefill.shutdown()
    decode.shutdown()
