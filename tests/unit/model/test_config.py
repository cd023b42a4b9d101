import json

import pytest

from disagg.worker.model import ModelConfig

BASE = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 100,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 512,
    "eos_token_id": 2,
    "torch_dtype": "bfloat16",
}


def test_llama_defaults():
    c = ModelConfig.from_dict(BASE)
    assert (c.head_dim, c.num_queries_per_kv, c.rope_theta, c.rope_scaling) == (16, 2, 10000.0, None)
    assert (c.qkv_bias, c.o_bias, c.tie_word_embeddings, c.eos_token_ids, c.dtype) == (
        False, False, False, (2,), "bfloat16")


def test_unknown_architecture_names_it_and_the_supported_ones():
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel.*LlamaForCausalLM.*Qwen2ForCausalLM.*MistralForCausalLM"):
        ModelConfig.from_dict({**BASE, "architectures": ["GPT2LMHeadModel"]})


def test_qwen2_has_qkv_bias_only_and_llama_attention_bias_covers_o_proj():
    qwen = ModelConfig.from_dict({**BASE, "architectures": ["Qwen2ForCausalLM"]})
    llama = ModelConfig.from_dict({**BASE, "attention_bias": True})
    assert (qwen.qkv_bias, qwen.o_bias) == (True, False)
    assert (llama.qkv_bias, llama.o_bias) == (True, True)


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}


@pytest.mark.parametrize(
    "fields",
    [
        {"rope_theta": 500000.0, "rope_scaling": LLAMA3},  # transformers 4 layout
        {"rope_parameters": {**LLAMA3, "rope_theta": 500000.0}},  # transformers 5 layout
    ],
)
def test_llama3_rope_scaling_in_both_layouts(fields):
    c = ModelConfig.from_dict({**BASE, **fields})
    assert c.rope_theta == 500000.0
    assert (c.rope_scaling.rope_type, c.rope_scaling.factor, c.rope_scaling.original_max_position_embeddings) == (
        "llama3", 8.0, 8192)


def test_linear_rope_legacy_type_key():
    c = ModelConfig.from_dict({**BASE, "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert (c.rope_scaling.rope_type, c.rope_scaling.factor) == ("linear", 2.0)


def test_unknown_rope_type_is_rejected():
    with pytest.raises(ValueError, match="yarn"):
        ModelConfig.from_dict({**BASE, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})


def test_eos_list_explicit_head_dim_and_dtype_key():
    c = ModelConfig.from_dict({**BASE, "eos_token_id": [2, 7], "head_dim": 32, "dtype": "float16"})
    assert (c.eos_token_ids, c.head_dim, c.dtype) == ((2, 7), 32, "float16")


def test_missing_config_json_names_the_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match=f"config.json.*{tmp_path}"):
        ModelConfig.from_dir(tmp_path)


def test_from_dir_reads_config_json(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(BASE))
    assert ModelConfig.from_dir(tmp_path).num_key_value_heads == 2
