"""The sampler's logit processors and logprobs: batched tensor ops equal to a plain per-row definition, rows
that do not ask are untouched; n > 1 choices share the prompt's KV blocks; a grammar replays generated tokens."""
from __future__ import annotations

import math

import pytest
import torch

from disagg.worker.sampling_params import SamplingParams, StructuredOutputSpec
from disagg.worker.runner.logprobs import token_logprobs
from disagg.worker.runner.penalties import apply_logit_bias, apply_min_tokens, apply_penalties
from disagg.worker.runner.sampler import SamplingBatch, sample_batch

V = 50


def reference_penalties(row: torch.Tensor, p: SamplingParams, prompt: list[int], out: list[int]) -> torch.Tensor:
    row = row.clone()
    for t in set(prompt) | set(out):
        row[t] = row[t] / p.repetition_penalty if row[t] > 0 else row[t] * p.repetition_penalty
    for t in set(out):
        row[t] -= p.frequency_penalty * out.count(t) + p.presence_penalty
    return row


def test_batched_penalties_equal_the_per_row_definition():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, V, generator=g)
    params = [SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=1.3),
              SamplingParams(),  # no penalty: untouched
              SamplingParams(repetition_penalty=0.7),
              SamplingParams(frequency_penalty=-1.0)]
    prompts = [[1, 2, 3], [4, 5], [6], [7, 7]]
    outs = [[3, 3, 9], [5], [6, 8, 8], []]
    token_ids = [p + o for p, o in zip(prompts, outs)]
    got = logits.clone()
    apply_penalties(got, params, token_ids, [len(p) for p in prompts])
    for i, p in enumerate(params):
        assert torch.allclose(got[i], reference_penalties(logits[i], p, prompts[i], outs[i])), i
    assert torch.equal(got[1], logits[1])


def test_logit_bias_and_min_tokens_touch_only_their_rows():
    logits = torch.zeros(3, V)
    params = [SamplingParams(logit_bias={4: 2.5, 7: -100}), SamplingParams(),
              SamplingParams(min_tokens=2, stop_token_ids=[9])]
    params[2].eos_token_ids = frozenset({1})
    apply_logit_bias(logits, params)
    apply_min_tokens(logits, params, [[0], [0], [0, 5]], [1, 1, 1])  # row 2 has 1 output < min_tokens
    assert logits[0, 4] == 2.5 and logits[0, 7] == -100 and logits[0].abs().sum() == 102.5
    assert logits[1].abs().sum() == 0
    assert logits[2, 1] == -math.inf and logits[2, 9] == -math.inf and torch.isfinite(logits[2, [0, 2, 3]]).all()
    done = torch.zeros(1, V)
    apply_min_tokens(done, [params[2]], [[0, 5, 6]], [1])  # 2 outputs: no longer masked
    assert torch.isfinite(done).all()


def test_min_p_one_keeps_only_the_top_token_and_plain_rows_are_greedy():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, V, generator=g)
    params = [SamplingParams(temperature=1.0, min_p=1.0), SamplingParams(temperature=0), SamplingParams(temperature=0)]
    gens = [torch.Generator().manual_seed(s) for s in range(3)]
    ids, lps = sample_batch(logits.clone(), SamplingBatch(params, gens))
    assert ids == logits.argmax(-1).tolist() and lps == [None, None, None]


def test_logprobs_are_the_raw_log_softmax_with_ranks_and_top_k():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(2, V, generator=g)
    params = [SamplingParams(temperature=0, logprobs=3, logit_bias={5: 50.0}), SamplingParams(temperature=0)]
    ids, lps = sample_batch(logits.clone(), SamplingBatch(params, [None, None]))
    assert ids[0] == 5 and lps[1] is None  # the bias steers the choice, not the reported logprobs
    ref = torch.log_softmax(logits[0], -1)
    assert lps[0].logprob == pytest.approx(ref[5].item(), abs=1e-6)
    assert lps[0].rank == int((ref > ref[5]).sum()) + 1
    assert [t for t, _ in lps[0].top] == ref.topk(3).indices.tolist()
    entries = token_logprobs(logits, [0, 1], [0, 2])
    assert entries[0].top == [] and len(entries[1].top) == 2


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    from disagg.worker.config import EngineConfig
    from disagg.worker.engine.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(model=tiny_model_dir, dtype="float32", max_model_len=256, num_kv_blocks=64,
                                  block_size=4))


def test_n_choices_fork_from_one_prompt_sharing_its_full_blocks(engine):
    prompt = list(range(10, 24))  # 14 tokens: 3 full blocks of 4 and a partial one
    engine.add_request(prompt, SamplingParams(max_tokens=4, temperature=1.0, seed=1, n=3, ignore_eos=True), "fork")
    scheduled: list[dict[str, int]] = []
    outs = {}
    while engine.has_unfinished_requests():
        tables = {r: list(engine.kv_cache_manager.get_block_ids(r)) for r in engine.scheduler.requests}
        engine_step = engine.step()
        scheduled.append(tables)
        for o in engine_step:
            outs[o.outputs[0].index] = o
    assert sorted(outs) == [0, 1, 2] and all(o.request_id == "fork" for o in outs.values())
    assert outs[2].finished and len({tuple(o.outputs[0].token_ids) for o in outs.values()}) > 1
    tables = next(t for t in scheduled if len([b for b in t.values() if b]) == 3)
    first = [tables[f"fork#c{i}"][:3] for i in range(3)]
    assert first[0] == first[1] == first[2]  # the full prompt blocks are the same blocks (ref counted)
    assert engine.kv_cache_manager.usage() == 0  # every reference released


def test_grammar_matcher_replays_generated_tokens(engine):
    from disagg.worker.engine.structured_output import GrammarCompiler
    from disagg.worker.runner.grammar_mask import new_matcher
    import xgrammar as xgr

    compiler = GrammarCompiler(engine.tokenizer, engine.model_config.vocab_size, sorted(engine.eos_token_ids))
    spec = StructuredOutputSpec(regex="abc[0-9]+")
    spec.compiled = compiler.compile(spec)
    sp = SamplingParams(structured_output=spec)
    done = engine.tokenizer.encode("abc", add_special_tokens=False)
    matcher = new_matcher(sp, done)
    mask = xgr.allocate_token_bitmask(1, engine.model_config.vocab_size)
    matcher.fill_next_token_bitmask(mask, 0)
    logits = torch.zeros(1, engine.model_config.vocab_size)
    xgr.apply_token_bitmask_inplace(logits, mask)
    allowed = [engine.tokenizer.decode([t]) for t in torch.isfinite(logits[0]).nonzero().flatten().tolist()]
    assert allowed and all(a.isdigit() for a in allowed), allowed
    with pytest.raises(ValueError, match="structured output"):
        compiler.compile(StructuredOutputSpec(json={"type": "nonsense"}))


def test_prompt_logprobs_over_chunked_prefill_equal_one_shot(engine, tiny_model_dir):
    from disagg.worker.config import EngineConfig
    from disagg.worker.engine.llm_engine import LLMEngine

    chunked = LLMEngine(EngineConfig(model=tiny_model_dir, dtype="float32", max_model_len=256, num_kv_blocks=64,
                                     block_size=4, max_num_batched_tokens=5))
    prompt = list(range(30, 47))  # 17 tokens: four chunks of at most 5

    def prompt_logprobs(e: LLMEngine) -> list:
        e.add_request(prompt, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=2))
        last = None
        while e.has_unfinished_requests():
            last = next(iter(e.step()), last)
        return last.prompt_logprobs

    one, many = prompt_logprobs(engine), prompt_logprobs(chunked)
    assert len(one) == len(many) == len(prompt) and one[0] is None and many[0] is None
    assert [e.token_id for e in many[1:]] == prompt[1:]
    for a, b in zip(one[1:], many[1:]):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-5) and len(b.top) == 2
