"""Parity with transformers (the reference) through the paged KV cache."""
from __future__ import annotations

import pytest
import torch

from disagg.worker.forward_context import ForwardContext, set_forward_context
from disagg.worker.model import load_model

HF_KINDS = ["llama_gqa", "llama3_rope", "linear_rope", "qwen2_tied", "mistral"]
ATOL = 1e-4
PROMPTS = [
    [5, 17, 33, 2, 81, 9, 9, 40, 12, 61, 7],
    [3, 14, 15, 92, 65],
    [71],
    [8, 60, 21, 44, 19, 50, 90, 1, 2, 3, 4, 5, 6, 7, 11, 13, 17, 19],
]


def hf_logits(hf_model, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([prompt])).logits[0].float()  # (L, vocab)


@pytest.mark.parametrize("kind", HF_KINDS)
def test_batched_prefill_matches_transformers(hf_checkpoint, paged_kv, kind):
    path, hf_model = hf_checkpoint(kind)
    model, config = load_model(path)
    kv = paged_kv(config)
    # STEP 1: every prompt is a prefill request in one batch
    logits = kv.step(model, [(f"r{i}", p) for i, p in enumerate(PROMPTS)])
    for prompt, got in zip(PROMPTS, logits):
        torch.testing.assert_close(got, hf_logits(hf_model, prompt), atol=ATOL, rtol=0)


@pytest.mark.parametrize("kind", ["llama_gqa", "llama3_rope", "qwen2_tied"])
def test_dummy_run_without_metadata_is_plain_causal(hf_checkpoint, paged_kv, kind):
    path, hf_model = hf_checkpoint(kind)
    model, _ = load_model(path)
    prompt = PROMPTS[0]
    with set_forward_context(ForwardContext(attn_metadata=None, kv_cache=None)):
        got = model.compute_logits(model(torch.tensor(prompt), torch.arange(len(prompt))))
    torch.testing.assert_close(got, hf_logits(hf_model, prompt), atol=ATOL, rtol=0)


@pytest.mark.parametrize("kind", HF_KINDS)
def test_greedy_paged_decoding_matches_generate(hf_checkpoint, paged_kv, kind):
    path, hf_model = hf_checkpoint(kind)
    model, config = load_model(path)
    max_new = 10
    expected = {}
    for i, prompt in enumerate(PROMPTS[:3]):
        out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False)
        expected[f"r{i}"] = out[0, len(prompt) :].tolist()
    kv = paged_kv(config, block_size=4)
    generated: dict[str, list[int]] = {}

    def record(batch, logits):
        for (req_id, _), lg in zip(batch, logits):
            generated.setdefault(req_id, []).append(int(lg[-1].argmax()))

    # STEP 1: prefill r0 and r1 together
    batch = [("r0", PROMPTS[0]), ("r1", PROMPTS[1])]
    record(batch, kv.step(model, batch))
    # STEP 2: decode r0 and r1 while r2 prefills (mixed batch, decodes first)
    batch = [("r0", generated["r0"][-1:]), ("r1", generated["r1"][-1:]), ("r2", PROMPTS[2])]
    record(batch, kv.step(model, batch))
    # STEP 3..: batched decode of every unfinished request (different context lengths)
    while any(len(g) < max_new for g in generated.values()):
        batch = [(r, g[-1:]) for r, g in generated.items() if len(g) < max_new]
        record(batch, kv.step(model, batch))
    assert generated == expected


@pytest.mark.parametrize("kind", ["llama_gqa", "mistral"])
def test_chunk_after_cached_prefix_matches_full_prefill(hf_checkpoint, paged_kv, kind):
    path, hf_model = hf_checkpoint(kind)
    model, config = load_model(path)
    prompt = PROMPTS[3]
    full = hf_logits(hf_model, prompt)
    kv = paged_kv(config, block_size=4)
    # STEP 1: first 6 tokens (ends mid-block), alongside another prefill
    first, _ = kv.step(model, [("long", prompt[:6]), ("other", PROMPTS[1])])
    # STEP 2: a decode for "other", then the rest of "long" on top of its cached prefix
    nxt = int(first[-1].argmax())
    _, rest = kv.step(model, [("other", [nxt]), ("long", prompt[6:])])
    torch.testing.assert_close(first, full[:6], atol=ATOL, rtol=0)
    torch.testing.assert_close(rest, full[6:], atol=ATOL, rtol=0)


class RecordingConnector:
    def __init__(self):
        self.calls: list[tuple[str, str]] = []

    def wait_for_layer_load(self, layer_name):
        self.calls.append(("wait", layer_name))

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        assert kv_layer.dim() == 6  # the whole cache, every layer
        self.calls.append(("save", layer_name))


def test_connector_hooks_called_per_layer_in_order(hf_checkpoint, paged_kv):
    path, _ = hf_checkpoint("llama_gqa")
    model, config = load_model(path)
    connector = RecordingConnector()
    paged_kv(config).step(model, [("r0", PROMPTS[1])], connector=connector)
    expected = []
    for i in range(config.num_hidden_layers):
        expected += [("wait", f"model.layers.{i}.self_attn"), ("save", f"model.layers.{i}.self_attn")]
    assert connector.calls == expected


def test_kv_written_at_slot_mapping(hf_checkpoint, paged_kv):
    path, _ = hf_checkpoint("llama_gqa")
    model, config = load_model(path)
    kv = paged_kv(config, block_size=4)
    kv.step(model, [("r0", PROMPTS[1])])
    written = kv.kv_cache.abs().sum(dim=(1, 2, 4, 5)) != 0  # (num_blocks, block_size)
    blocks = kv.blocks["r0"]
    assert written.sum() == len(PROMPTS[1])
    assert written[blocks[0]].all() and written[blocks[1], 0] and not written[blocks[1], 1:].any()
