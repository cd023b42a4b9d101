"""write_tiny_checkpoint: a complete, small, random-weight Hugging Face checkpoint, made without transformers.

It is the embedded default model (the product runs end to end with no download) and the tests' fixture.
Weights are seeded; a byte-level BPE tokenizer is trained in-process on a built-in corpus.
"""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from disagg.worker.model.config import DTYPE_NAMES
from disagg.worker.model.registry import ARCHITECTURES, SUPPORTED_ARCHITECTURES
from disagg.worker.model.tiny_corpus import CORPUS

TOKENIZER_VOCAB_SIZE = 768
BOS, EOS, END = "<s>", "</s>", "<|end|>"
SPECIAL_TOKENS = [BOS, EOS, "<|system|>", "<|user|>", "<|assistant|>", END, "<pad>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>\n"
    "{{ message['content'] }}<|end|>\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def build_tokenizer() -> HFTokenizer:
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS.splitlines(keepends=True), trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return tok


def tiny_weights(
    config: dict, *, generator: torch.Generator, dtype: torch.dtype, qkv_bias: bool
) -> dict[str, torch.Tensor]:
    """HF-named tensors: normal(0, 0.02) matrices and biases, ones for norms."""
    d, inter, hd = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    n_q, n_kv = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd

    def normal(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator) * 0.02).to(dtype)

    w = {"model.embed_tokens.weight": normal(config["vocab_size"], d)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        for name, rows in (("q_proj", n_q), ("k_proj", n_kv), ("v_proj", n_kv)):
            w[p + f"self_attn.{name}.weight"] = normal(rows, d)
            if qkv_bias:
                w[p + f"self_attn.{name}.bias"] = normal(rows)
        w[p + "self_attn.o_proj.weight"] = normal(d, n_q)
        w[p + "mlp.gate_proj.weight"] = normal(inter, d)
        w[p + "mlp.up_proj.weight"] = normal(inter, d)
        w[p + "mlp.down_proj.weight"] = normal(d, inter)
        w[p + "input_layernorm.weight"] = torch.ones(d, dtype=dtype)
        w[p + "post_attention_layernorm.weight"] = torch.ones(d, dtype=dtype)
    w["model.norm.weight"] = torch.ones(d, dtype=dtype)
    if not config["tie_word_embeddings"]:
        w["lm_head.weight"] = normal(config["vocab_size"], d)
    return w


def write_tiny_checkpoint(
    path: str | Path,
    *,
    architecture: str = "LlamaForCausalLM",
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    vocab_size: int | None = None,
    tie_word_embeddings: bool = False,
    dtype: str = "float32",
    seed: int = 0,
    max_position_embeddings: int = 2048,
    sharded: bool = False,
) -> Path:
    """Write config.json, safetensors weights, tokenizer.json and tokenizer_config.json into `path`.

    vocab_size defaults to the tokenizer's (768) and may only be larger (unused rows)."""
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"architecture={architecture!r}: expected one of {', '.join(SUPPORTED_ARCHITECTURES)}")
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"dtype={dtype!r}: expected one of {', '.join(DTYPE_NAMES)}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    n_tok = tok.get_vocab_size(with_added_tokens=True)
    if vocab_size is not None and vocab_size < n_tok:
        raise ValueError(f"vocab_size={vocab_size} is smaller than the tokenizer's vocabulary ({n_tok})")
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    config = {
        "architectures": [architecture],
        "model_type": ARCHITECTURES[architecture].model_type,
        "vocab_size": vocab_size or n_tok,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": hidden_size // num_heads,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": max_position_embeddings,
        "tie_word_embeddings": tie_word_embeddings,
        "bos_token_id": ids[BOS],
        "eos_token_id": [ids[EOS], ids[END]],
        "torch_dtype": dtype,
    }
    generator = torch.Generator().manual_seed(seed)
    weights = tiny_weights(
        config, generator=generator, dtype=getattr(torch, dtype), qkv_bias=ARCHITECTURES[architecture].qkv_bias
    )
    _write_json(path / "config.json", config)
    _write_weights(path, weights, sharded)
    tok.save(str(path / "tokenizer.json"))
    _write_json(
        path / "tokenizer_config.json",
        {
            "bos_token": BOS,
            "eos_token": EOS,
            "pad_token": "<pad>",
            "add_bos_token": True,
            "chat_template": CHAT_TEMPLATE,
            "model_max_length": max_position_embeddings,
            "tokenizer_class": "PreTrainedTokenizerFast",
        },
    )
    return path


def _write_weights(path: Path, weights: dict[str, torch.Tensor], sharded: bool) -> None:
    if not sharded:
        save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
        return
    names = list(weights)
    half = len(names) // 2
    shards = [names[:half], names[half:]]
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards, start=1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file({n: weights[n] for n in shard}, str(path / file), metadata={"format": "pt"})
        weight_map.update({n: file for n in shard})
    total = sum(t.numel() * t.element_size() for t in weights.values())
    _write_json(path / "model.safetensors.index.json", {"metadata": {"total_size": total}, "weight_map": weight_map})


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")


def default_model_dir() -> Path:
    """The embedded default: a tiny random-weight checkpoint, generated once into a cache dir."""
    cache = Path.home() / ".cache" / "disagg" / "tiny-llama"
    if not (cache / "config.json").exists():
        tmp = Path(tempfile.mkdtemp(dir=cache.parent if cache.parent.exists() else None))
        write_tiny_checkpoint(tmp)
        cache.parent.mkdir(parents=True, exist_ok=True)
        try:
            tmp.rename(cache)
        except OSError:  # another process won the race
            pass
    return cache
