"""What the offline LLM promises beyond tokens: seeded sampling, cached-token counts, bounded connector stats."""
from __future__ import annotations

from disagg.worker import LLM, SamplingParams

SAMPLED = SamplingParams(max_tokens=24, temperature=1.0, ignore_eos=True)  # no per-request seed
PROMPTS = ["The history of the city begins", "In the morning the engineers", "short one"]


def sampled_texts(model_dir: str, seed: int) -> list[str]:
    llm = LLM(model_dir, max_model_len=256, num_kv_blocks=64, seed=seed)
    try:
        return [o.outputs[0].text for o in llm.generate(PROMPTS, SAMPLED)]
    finally:
        llm.shutdown()


def test_engine_seed_makes_sampling_repeatable_within_one_process(tiny_model_dir):
    first = sampled_texts(tiny_model_dir, seed=1234)
    # a second engine in the same process: torch's global generator has moved on, the engine's seed has not
    assert sampled_texts(tiny_model_dir, seed=1234) == first
    assert sampled_texts(tiny_model_dir, seed=4321) != first, "the seed must decide the samples"


def test_num_cached_tokens_counts_prefix_cache_hits(tiny_model_dir):
    llm = LLM(tiny_model_dir, max_model_len=256, num_kv_blocks=64, block_size=16)
    prompt = list(range(10, 50))  # 40 tokens: two full blocks of 16, then 8
    greedy = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    first = llm.generate([prompt], greedy)[0]
    again = llm.generate([prompt], greedy)[0]
    other = llm.generate([list(range(100, 140))], greedy)[0]
    assert (first.num_cached_tokens, again.num_cached_tokens, other.num_cached_tokens) == (0, 32, 0)
    assert again.outputs[0].token_ids == first.outputs[0].token_ids


def test_num_cached_tokens_counts_remote_kv(tiny_model_dir):
    llm = LLM(tiny_model_dir, max_model_len=256, num_kv_blocks=64,
              kv_transfer_config={"kv_connector_module_path": "recording_connector:RecordingConnector"})
    prompt = list(range(10, 30))
    out = llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0),
                       kv_transfer_params=[{"fake_remote": True}])[0]
    assert out.num_cached_tokens == len(prompt) - 1  # the last prompt token is recomputed for its logits


def test_connector_stats_hold_the_latest_generate_only(tiny_model_dir, tmp_path):
    calls = 3
    llm = LLM(tiny_model_dir, max_model_len=256, num_kv_blocks=64, kv_transfer_config={
        "kv_connector": "SharedStorageConnector", "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": str(tmp_path)}})
    greedy = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    sizes = []
    for i in range(calls):  # same shape of work each call, new prompts (nothing cached)
        llm.generate([[100 + i] * 40, [200 + i] * 40], greedy)
        stats = llm.engine.stats.kv_connector_stats
        assert sum(s["bytes_saved"] for s in stats) > 0
        sizes.append(len(stats))
    assert sizes == [sizes[0]] * calls, f"connector stats piled up across calls: {sizes}"
    llm.shutdown()
