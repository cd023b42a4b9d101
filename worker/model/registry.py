"""Architecture registry: config.json's `architectures[0]` -> the model class that implements it.

Adding a model family: write its module (reusing paged_attention.PagedAttention for the KV cache, and
llama.py's RMSNorm / RotaryEmbedding / Linear where they fit), then add one entry below. The class
must follow the contract of `CausalLMModel`; its parameter names must be the checkpoint's tensor names
(the loader ties `lm_head.weight` to `model.embed_tokens.weight` under tie_word_embeddings).
Classes are named as "module:Class" strings and imported on first use, so reading a config
(ModelConfig, write_tiny_checkpoint's checks) imports no model code.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from disagg.worker.model.config import ModelConfig


class CausalLMModel(Protocol):
    """What the loader and the model runner use of a model (an nn.Module)."""

    def __init__(self, config: "ModelConfig") -> None: ...

    def forward(self, input_ids: "torch.Tensor", positions: "torch.Tensor") -> "torch.Tensor":
        """(T,), (T,) int64 -> hidden states (T, hidden); attention reads the forward context."""

    def compute_logits(self, hidden: "torch.Tensor") -> "torch.Tensor":
        """(N, hidden) -> (N, vocab) float32."""


@dataclass(frozen=True)
class Architecture:
    model_class: str  # "package.module:Class"
    model_type: str  # config.json's model_type (write_tiny_checkpoint writes it)
    qkv_bias: bool = False  # q/k/v projections always carry a bias, whatever attention_bias says


ARCHITECTURES: MappingProxyType[str, Architecture] = MappingProxyType({
    "LlamaForCausalLM": Architecture("disagg.worker.model.llama:CausalLM", "llama"),
    "Qwen2ForCausalLM": Architecture("disagg.worker.model.llama:CausalLM", "qwen2", qkv_bias=True),
    "MistralForCausalLM": Architecture("disagg.worker.model.llama:CausalLM", "mistral"),
})
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)


def get_architecture(name: str | None) -> Architecture:
    """The registered entry; ValueError naming `name` and every supported one otherwise."""
    arch = ARCHITECTURES.get(name) if name is not None else None
    if arch is None:
        raise ValueError(f"unsupported architecture {name!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    return arch


def model_class(name: str) -> type[CausalLMModel]:
    """The class implementing architecture `name` (imported now)."""
    module_name, _, class_name = get_architecture(name).model_class.partition(":")
    return getattr(importlib.import_module(module_name), class_name)
