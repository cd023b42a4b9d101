"""Fixtures for the model tests: a hand-built paged KV cache and tiny transformers reference checkpoints."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from disagg.worker.forward_context import AttentionMetadata, ForwardContext, set_forward_context
from disagg.worker.model import ModelConfig


@dataclass
class PagedKV:
    """A KV cache plus per-request block lists, enough to drive the model like an engine would.

    Block ids are handed out in a shuffled order, so a request's blocks are not contiguous."""

    config: ModelConfig
    num_blocks: int = 64
    block_size: int = 4
    dtype: torch.dtype = torch.float32
    seed: int = 0
    kv_cache: torch.Tensor = field(init=False)
    free_blocks: list[int] = field(init=False)
    blocks: dict[str, list[int]] = field(default_factory=dict)  # req_id -> block ids
    num_cached: dict[str, int] = field(default_factory=dict)  # req_id -> tokens already in the cache

    def __post_init__(self) -> None:
        c = self.config
        shape = (self.num_blocks, c.num_hidden_layers, 2, self.block_size, c.num_key_value_heads, c.head_dim)
        self.kv_cache = torch.zeros(shape, dtype=self.dtype)
        self.free_blocks = torch.randperm(self.num_blocks, generator=torch.Generator().manual_seed(self.seed)).tolist()

    def build_metadata(
        self, batch: list[tuple[str, list[int]]]
    ) -> tuple[AttentionMetadata, torch.Tensor, torch.Tensor]:
        """batch: (req_id, new token ids), single-token requests first. -> (metadata, input_ids, positions)."""
        num_decodes = 0
        while num_decodes < len(batch) and len(batch[num_decodes][1]) == 1:
            num_decodes += 1
        input_ids, positions, slots, seq_lens, query_start_loc = [], [], [], [], [0]
        for req_id, new_ids in batch:
            start = self.num_cached.get(req_id, 0)
            seq_len = start + len(new_ids)
            blocks = self.blocks.setdefault(req_id, [])
            while len(blocks) * self.block_size < seq_len:
                blocks.append(self.free_blocks.pop())
            for pos in range(start, seq_len):
                slots.append(blocks[pos // self.block_size] * self.block_size + pos % self.block_size)
            input_ids += new_ids
            positions += range(start, seq_len)
            seq_lens.append(seq_len)
            query_start_loc.append(query_start_loc[-1] + len(new_ids))
            self.num_cached[req_id] = seq_len
        max_blocks = max(len(self.blocks[r]) for r, _ in batch)
        block_tables = torch.zeros(len(batch), max_blocks, dtype=torch.int64)
        for i, (req_id, _) in enumerate(batch):
            block_tables[i, : len(self.blocks[req_id])] = torch.tensor(self.blocks[req_id])
        md = AttentionMetadata(
            num_decodes=num_decodes,
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            seq_lens_tensor=torch.tensor(seq_lens, dtype=torch.int64),
            block_tables=block_tables,
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            block_size=self.block_size,
        )
        return md, torch.tensor(input_ids, dtype=torch.int64), torch.tensor(positions, dtype=torch.int64)

    def step(self, model, batch: list[tuple[str, list[int]]], connector=None) -> list[torch.Tensor]:
        """Run one forward; returns each request's logits (n_new, vocab), in batch order."""
        md, input_ids, positions = self.build_metadata(batch)
        with set_forward_context(ForwardContext(md, self.kv_cache, connector)):
            logits = model.compute_logits(model(input_ids, positions))
        q = md.query_start_loc
        return [logits[q[i] : q[i + 1]] for i in range(len(batch))]


def _hf_config(kind: str):
    import transformers

    common = dict(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=256,
        initializer_range=0.1,  # peaked logits, so greedy argmax has no near-ties
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    if kind == "llama_gqa":
        return transformers.LlamaConfig(num_key_value_heads=2, tie_word_embeddings=False, **common)
    if kind == "llama3_rope":
        scaling = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                       original_max_position_embeddings=16, rope_theta=500000.0)
        return transformers.LlamaConfig(num_key_value_heads=1, rope_scaling=scaling, **common)
    if kind == "linear_rope":
        return transformers.LlamaConfig(num_key_value_heads=4, rope_scaling=dict(rope_type="linear", factor=2.0),
                                        attention_bias=True, **common)
    if kind == "qwen2_tied":
        return transformers.Qwen2Config(num_key_value_heads=2, tie_word_embeddings=True, **common)
    if kind == "mistral":
        return transformers.MistralConfig(num_key_value_heads=2, head_dim=16, sliding_window=None, **common)
    raise ValueError(f"unknown reference checkpoint kind {kind!r}")


@pytest.fixture
def paged_kv():
    """The PagedKV class: paged_kv(config, block_size=4) -> a fresh cache."""
    return PagedKV


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory):
    """kind -> (checkpoint dir, transformers reference model in float32 eval mode); built once per kind."""
    pytest.importorskip("transformers")
    import transformers

    built: dict[str, tuple[Path, torch.nn.Module]] = {}

    def make(kind: str) -> tuple[Path, torch.nn.Module]:
        if kind not in built:
            torch.manual_seed(0)
            config = _hf_config(kind)
            config._attn_implementation = "eager"
            model = transformers.AutoModelForCausalLM.from_config(config).eval()
            path = tmp_path_factory.mktemp(kind)
            model.save_pretrained(path, safe_serialization=True)
            built[kind] = (path, model)
        return built[kind]

    return make
