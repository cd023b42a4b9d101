"""The architecture registry: config.json's architecture -> model class, and its per-family config facts."""
from __future__ import annotations

import pytest

from disagg.worker.model import ModelConfig
from disagg.worker.model.llama import CausalLM
from disagg.worker.model.registry import ARCHITECTURES, SUPPORTED_ARCHITECTURES, model_class


@pytest.mark.parametrize("name", ["LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM"])
def test_llama_family_shares_one_implementation(name):
    assert model_class(name) is CausalLM


def test_unknown_architecture_names_it_and_the_supported_ones():
    with pytest.raises(ValueError, match=r"'GPT2LMHeadModel'.*LlamaForCausalLM.*Qwen2ForCausalLM"):
        model_class("GPT2LMHeadModel")


def test_config_takes_the_qkv_bias_fact_from_the_registry():
    base = {"architectures": ["LlamaForCausalLM"], "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
            "num_hidden_layers": 1, "num_attention_heads": 2}
    assert [ModelConfig.from_dict({**base, "architectures": [a]}).qkv_bias for a in SUPPORTED_ARCHITECTURES] == [
        ARCHITECTURES[a].qkv_bias for a in SUPPORTED_ARCHITECTURES]
    assert ARCHITECTURES["Qwen2ForCausalLM"].qkv_bias and not ARCHITECTURES["LlamaForCausalLM"].qkv_bias


def test_registry_is_read_only():
    with pytest.raises(TypeError):
        ARCHITECTURES["X"] = ARCHITECTURES["LlamaForCausalLM"]  # type: ignore[index]
