"""ModelConfig: the fields of a Hugging Face config.json that the registered model families need.

Sliding-window attention (Mistral's `sliding_window`, Qwen2's `use_sliding_window`) is ignored:
every layer attends to the whole context. That is exact for contexts shorter than the window.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from disagg.worker.model.registry import SUPPORTED_ARCHITECTURES, get_architecture

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
DTYPE_NAMES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class RopeScaling:
    rope_type: str  # "linear" | "llama3"
    factor: float
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position_embeddings: int = 8192  # llama3 only


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # a key of registry.ARCHITECTURES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int  # < num_attention_heads for grouped-query attention
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool  # bias on q/k/v projections (Qwen2 always, Llama with attention_bias)
    o_bias: bool  # bias on the output projection (Llama with attention_bias)
    mlp_bias: bool
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    dtype: str  # checkpoint dtype, one of DTYPE_NAMES

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ModelConfig":
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no config.json in model directory {str(model_dir)!r}")
        with path.open() as f:
            return cls.from_dict(json.load(f))

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> "ModelConfig":
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else None
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {arch!r} (architectures={archs!r}); "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        family = get_architecture(arch)
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        if heads % kv_heads:
            raise ValueError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
        attention_bias = bool(cfg.get("attention_bias", False))
        rope = _rope_parameters(cfg)
        return cls(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_hidden_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
            rope_scaling=_rope_scaling(rope),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=family.qkv_bias or attention_bias,
            o_bias=attention_bias and not family.qkv_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            eos_token_ids=_token_ids(cfg.get("eos_token_id")),
            bos_token_id=cfg.get("bos_token_id"),
            dtype=_dtype_name(cfg.get("dtype") or cfg.get("torch_dtype") or "float32"),
        )


def _rope_parameters(cfg: dict[str, Any]) -> dict[str, Any]:
    # transformers >= 5 writes `rope_parameters` (with rope_theta inside); older versions
    # write `rope_theta` and `rope_scaling` at the top level.
    params = cfg.get("rope_parameters")
    if params is None:
        params = cfg.get("rope_scaling") or {}
    return dict(params)


def _rope_scaling(params: dict[str, Any]) -> RopeScaling | None:
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    if rope_type == "default":
        return None
    if "factor" not in params:
        raise ValueError(f"rope scaling {rope_type!r} needs a 'factor'; got {params!r}")
    if rope_type == "linear":
        return RopeScaling("linear", float(params["factor"]))
    return RopeScaling(
        "llama3",
        factor=float(params["factor"]),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)),
    )


def _token_ids(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _dtype_name(value: str) -> str:
    name = str(value).removeprefix("torch.")
    if name not in DTYPE_NAMES:
        raise ValueError(f"unsupported checkpoint dtype {value!r}; supported: {', '.join(DTYPE_NAMES)}")
    return name
