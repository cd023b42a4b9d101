"""Bad input gets an error that names the value; nothing is queued or leaked; others keep going."""
from __future__ import annotations

import json
import shutil

import pytest

from disagg.worker import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(tiny_model_dir, max_model_len=64, num_kv_blocks=32)


def test_max_tokens_below_one_is_named():
    with pytest.raises(ValueError, match="max_tokens must be an integer >= 1, got 0"):
        SamplingParams(max_tokens=0)


def test_prompt_longer_than_max_model_len_names_both(llm):
    with pytest.raises(ValueError, match="prompt 1: prompt has 80 tokens; max_model_len is 64"):
        llm.generate([[1, 2, 3], list(range(1, 81))], SamplingParams(max_tokens=2))
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.kv_cache_manager.num_free_blocks == 32


def test_token_ids_outside_vocab_named(llm):
    with pytest.raises(ValueError, match=r"prompt token ids \[999999\] are outside the vocabulary"):
        llm.generate([[1, 999999]], SamplingParams(max_tokens=2))


def test_bad_request_does_not_disturb_running_ones(llm):
    engine = llm.engine
    good = engine.add_request([5, 6, 7, 8], SamplingParams(max_tokens=6, temperature=0))
    engine.step()
    with pytest.raises(ValueError, match="prompt is empty"):
        engine.add_request([], SamplingParams(max_tokens=2))
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert done[good].outputs[0].finish_reason == "length" and len(done[good].outputs[0].token_ids) == 6
    assert engine.kv_cache_manager.num_free_blocks == 32


def test_abort_frees_blocks(llm):
    engine = llm.engine
    rid = engine.add_request([5, 6, 7, 8, 9], SamplingParams(max_tokens=50))
    engine.step()
    engine.abort_request(rid)
    assert engine.scheduler.requests.get(rid) is None
    assert engine.kv_cache_manager.num_free_blocks == 32


def test_unknown_architecture_named(tiny_model_dir, tmp_path):
    shutil.copytree(tiny_model_dir, tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg["architectures"] = ["GPTNeoXForCausalLM"]
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="GPTNeoXForCausalLM"):
        LLM(str(tmp_path / "m"))


def test_missing_weight_tensor_named(tiny_model_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    shutil.copytree(tiny_model_dir, tmp_path / "m")
    weights = load_file(str(tmp_path / "m" / "model.safetensors"))
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, str(tmp_path / "m" / "model.safetensors"))
    with pytest.raises(Exception, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        LLM(str(tmp_path / "m"))


def test_stop_string_ends_generation_and_is_not_in_text(llm):
    free = llm.engine.kv_cache_manager.num_free_blocks
    base = llm.generate(["hello there"], SamplingParams(max_tokens=12, temperature=0))[0].outputs[0].text
    stop = base[3:6]
    out = llm.generate(["hello there"], SamplingParams(max_tokens=12, temperature=0, stop=[stop]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == base[: base.find(stop)]
    assert llm.engine.kv_cache_manager.num_free_blocks == free


def test_seeded_sampling_is_reproducible(llm):
    sp = SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9, top_k=50, seed=1234)
    a = llm.generate(["once upon"], sp)[0].outputs[0].token_ids
    b = llm.generate(["once upon"], sp)[0].outputs[0].token_ids
    assert a == b


def test_token_counters_count_each_prompt_once(tiny_model_dir):
    llm = LLM(tiny_model_dir, max_model_len=64, num_kv_blocks=32, max_num_batched_tokens=4)  # chunked prefill
    llm.generate([[5, 6, 7, 8, 9, 10, 11], [1, 2, 3]], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert llm.engine.stats.prompt_tokens == 10
    assert llm.engine.stats.generation_tokens == 6
