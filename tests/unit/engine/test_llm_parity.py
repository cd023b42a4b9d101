"""LLM.generate against transformers' greedy generate on tiny random-weight checkpoints."""
from __future__ import annotations

import shutil

import pytest
import torch

from disagg.worker import LLM, SamplingParams

transformers = pytest.importorskip("transformers")

PROMPTS = [[3, 17, 25, 9, 44, 61, 2, 8, 90, 31, 12], [5, 6], [70, 71, 72, 73, 74, 75, 76, 77, 78, 79, 80, 81, 82, 83, 84, 85, 86, 87, 88], [40, 41, 42, 43, 44]]
NEW_TOKENS = 12


def hf_config(kind: str):
    common = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=256, initializer_range=0.1, bos_token_id=None, eos_token_id=None,
                  pad_token_id=None)
    if kind == "llama_gqa_untied":
        return transformers.LlamaConfig(num_key_value_heads=2, tie_word_embeddings=False, **common)
    if kind == "qwen2_bias_tied":
        return transformers.Qwen2Config(num_key_value_heads=2, tie_word_embeddings=True, **common)
    raise ValueError(kind)


@pytest.fixture(scope="module", params=["llama_gqa_untied", "qwen2_bias_tied"])
def checkpoint(request, tmp_path_factory, tiny_model_dir):
    torch.manual_seed(0)
    config = hf_config(request.param)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):  # the engine loads a tokenizer; ids are used here
        shutil.copy(f"{tiny_model_dir}/{name}", path / name)
    return str(path), model


def reference_tokens(model, prompt: list[int]) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                             min_new_tokens=NEW_TOKENS, pad_token_id=0)
    return out[0, len(prompt):].tolist()


GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)


@pytest.fixture(params=["cpu_kernels", "torch_ops"])
def engine_paths(request, monkeypatch):
    """Both ways the engine computes on CPU: its own C kernels and oneDNN-packed weights (the default),
    and torch's ops alone (no C compiler, DISAGG_CPU_KERNELS=0, or a torch without weight packing)."""
    if request.param == "torch_ops":
        from disagg.worker.model import cpu_kernels
        from disagg.worker.model.llama import Linear

        monkeypatch.setattr(cpu_kernels, "_loaded", {"lib": None})
        monkeypatch.setattr(Linear, "_reorder", None)
    return request.param


def test_greedy_batch_matches_transformers(checkpoint, engine_paths):
    path, hf_model = checkpoint
    llm = LLM(path, max_model_len=256, num_kv_blocks=64, block_size=4)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == [reference_tokens(hf_model, p) for p in PROMPTS]
    assert llm.engine.kv_cache_manager.num_free_blocks == 64


def test_batched_equals_one_at_a_time_and_survives_preemption(checkpoint, engine_paths):
    path, _ = checkpoint
    one = LLM(path, max_model_len=256, num_kv_blocks=64, block_size=4, enable_prefix_caching=False)
    singles = [one.generate([p], GREEDY)[0].outputs[0].token_ids for p in PROMPTS]
    # 16 blocks of 4 tokens cannot hold all four requests to the end: preemption + recompute,
    # a token budget that chunks the long prompt, and prefix caching on
    tight = LLM(path, max_model_len=64, num_kv_blocks=16, block_size=4, max_num_batched_tokens=8)
    batched = tight.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in batched] == singles
    assert tight.engine.scheduler.num_preemptions_total > 0
    assert tight.engine.kv_cache_manager.num_free_blocks == 16


def test_prefix_cache_hit_gives_same_tokens(checkpoint):
    path, _ = checkpoint
    llm = LLM(path, max_model_len=256, num_kv_blocks=64, block_size=4)
    first = llm.generate([PROMPTS[2]], GREEDY)[0]
    again = llm.generate([PROMPTS[2]], GREEDY)[0]
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert llm.engine.kv_cache_manager.pool._cached  # blocks were cached and kept
