"""The router's KV index (from KV-cache events) and the prefix-aware scoring, table-driven: ordering,
restarts, losses, duplicates, load against prefix, the prefill skip, and the pool honouring the costs."""
from __future__ import annotations

import pytest

from disagg.worker.engine.block_pool import hash_request_blocks
from disagg.worker.kv_events.schema import AllBlocksCleared, BlockRemoved, BlockStored
from disagg.worker.router.endpoints import EndpointPool
from disagg.worker.router.kv_index import Applied, KVIndex
from disagg.worker.router.policy import Candidate
from disagg.worker.router.prefix_policy import PrefixPolicyConfig, plan_route

BS = 4
TOKENS = list(range(20))  # 5 full blocks
H = hash_request_blocks(TOKENS, BS, [])


def stored(*idx: int) -> BlockStored:
    first = idx[0]
    return BlockStored(block_hashes=[H[i] for i in idx], parent_block_hash=H[first - 1] if first else None,
                       token_ids=TOKENS[first * BS:(idx[-1] + 1) * BS], block_size=BS, lora_id=None,
                       medium="GPU", lora_name=None)


def removed(*idx: int) -> BlockRemoved:
    return BlockRemoved(block_hashes=[H[i] for i in idx], medium="GPU")


# (batches as (seq, events, replayed), expected outcomes, expected prefix blocks of TOKENS afterwards)
CASES = {
    "in order": ([(0, [AllBlocksCleared()], False), (1, [stored(0, 1, 2)], False)],
                 [Applied.IN_ORDER, Applied.IN_ORDER], 3),
    "removal cuts the prefix": ([(0, [stored(0, 1, 2, 3)], False), (1, [removed(1)], False)],
                                [Applied.IN_ORDER, Applied.IN_ORDER], 1),
    "a hole is not a prefix": ([(0, [stored(1, 2)], False)], [Applied.IN_ORDER], 0),
    "restart: sequence goes back": ([(0, [stored(0, 1)], False), (1, [stored(2)], False),
                                     (0, [AllBlocksCleared()], False)],
                                    [Applied.IN_ORDER, Applied.IN_ORDER, Applied.RESET], 0),
    "restart, then new blocks": ([(5, [stored(0, 1, 2)], False), (0, [stored(0)], False)],
                                 [Applied.GAP, Applied.RESET], 1),
    "gap clears what was known": ([(0, [stored(0, 1, 2)], False), (3, [stored(3)], False)],
                                  [Applied.IN_ORDER, Applied.GAP], 0),
    "all cleared": ([(0, [stored(0, 1, 2)], False), (1, [AllBlocksCleared(), stored(0)], False)],
                    [Applied.IN_ORDER, Applied.IN_ORDER], 1),
    "replayed duplicate ignored": ([(0, [stored(0, 1)], True), (1, [stored(2)], True), (1, [removed(0)], True)],
                                   [Applied.IN_ORDER, Applied.IN_ORDER, Applied.DUPLICATE], 3),
}


@pytest.mark.parametrize("batches, outcomes, prefix", CASES.values(), ids=CASES.keys())
def test_index_applies_batches(batches, outcomes, prefix):
    index = KVIndex()
    got = [index.apply("http://a", seq, events, replayed=replayed)[0] for seq, events, replayed in batches]
    assert got == outcomes
    assert index.prefix_blocks("http://a", H) == prefix


def test_gap_reports_how_many_batches_were_lost_and_drop_forgets_the_endpoint():
    index = KVIndex()
    index.apply("http://a", 0, [stored(0, 1)])
    assert index.apply("http://a", 4, [stored(0)]) == (Applied.GAP, 3)
    assert index.block_size("http://a") == BS
    assert index.apply("http://late", 7, [stored(0)]) == (Applied.GAP, 0)  # joined after the replay buffer wrapped
    index.apply("http://b", 0, [stored(0, 1, 2)])
    index.drop("http://a")
    assert index.prefix_blocks("http://a", H) == 0 and index.last_seq("http://a") is None
    assert index.prefix_blocks("http://b", H) == 3  # others are untouched


def cand(url: str, hit: int, load: float = 0.0, kv: float = 0.0) -> Candidate:
    return Candidate(url, hit, BS, load, kv)


CFG = PrefixPolicyConfig(load_cost_tokens=8.0, skip_prefill_max_missing_blocks=1)
# prompt of 21 tokens = 5 full blocks: (decode candidates, expected decode, expected skip_prefill)
PLANS = {
    "longest prefix wins": ([cand("a", 1), cand("b", 4)], "b", True),
    "no prefix anywhere: least loaded, no skip": ([cand("a", 0, load=2), cand("b", 0, load=1)], "b", False),
    "tie on cost goes to the least loaded": ([cand("a", 2, load=1), cand("b", 0, load=0, kv=0.0)], "b", False),
    "load outweighs a short prefix": ([cand("a", 2, load=3), cand("b", 0)], "b", False),
    "a long prefix outweighs some load": ([cand("a", 5, load=1), cand("b", 0)], "a", True),
    "missing more than the threshold: prefill runs": ([cand("a", 3), cand("b", 0)], "a", False),
    "kv usage counts as load": ([cand("a", 1, kv=0.9), cand("b", 1, kv=0.1)], "b", False),
    "no decode endpoint": ([], None, False),
}


@pytest.mark.parametrize("decode, want, skip", PLANS.values(), ids=PLANS.keys())
def test_plan_picks_decode_by_prefix_against_load(decode, want, skip):
    plan = plan_route(21, {BS: 5}, decode, [cand("p1", 0), cand("p2", 3)], CFG)
    assert (plan.decode_url, plan.skip_prefill) == (want, skip)
    assert min(plan.prefill_costs, key=plan.prefill_costs.get) == "p2"  # prefill: longest prefix too
    if want is not None:
        assert plan.decode_hit_tokens == next(c.hit_tokens for c in decode if c.url == want)


def test_pool_takes_the_cheapest_available_endpoint_and_skips_excluded_ones():
    pool = EndpointPool("decode", "prefix-aware")
    pool.set_urls(["http://a", "http://b", "http://c"])
    for ep in pool.endpoints.values():
        ep.ready = True
    costs = {"http://a": 30.0, "http://b": 10.0, "http://c": 20.0}
    assert pool.pick(costs=costs).url == "http://b"
    assert pool.pick({"http://b"}, costs=costs).url == "http://c"
    pool.endpoints["http://b"].ready = False
    assert pool.pick(costs=costs).url == "http://c"
    assert pool.pick(costs={}).url in {"http://a", "http://c"}  # unknown costs: all equal


@pytest.mark.parametrize("kwargs", [{"load_cost_tokens": -1}, {"skip_prefill_max_missing_blocks": -1}])
def test_bad_policy_config_is_rejected(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        PrefixPolicyConfig(**kwargs)


# ---------------------------------------------------------------- vLLM's hashes translated to ours
V = [0x9E3779B97F4A7C15 + i for i in range(5)]  # vLLM's own (64-bit int) hashes of TOKENS' blocks: not ours


def v_stored(*idx: int, block_size: int = BS, tokens: list[int] | None = None, parent: int | None = -1,
             **extra) -> BlockStored:
    first = idx[0]
    return BlockStored(block_hashes=[V[i] for i in idx],
                       parent_block_hash=(V[first - 1] if first else None) if parent == -1 else parent,
                       token_ids=TOKENS[first * BS:(idx[-1] + 1) * BS] if tokens is None else tokens,
                       block_size=block_size, **{"lora_id": None, "medium": "GPU", "lora_name": None, **extra})


def v_removed(*idx: int) -> BlockRemoved:
    return BlockRemoved(block_hashes=[V[i] for i in idx], medium="GPU", group_idx=0)


# (vLLM-shaped events in order, expected prefix blocks of TOKENS by OUR hashes, expected translation size)
TRANSLATION = {
    "one chain": ([v_stored(0, 1, 2)], 3, 3),
    "a chain over two events, through the parent": ([v_stored(0, 1), v_stored(2, 3, 4)], 5, 5),
    "unknown parent: left out": ([v_stored(2, 3)], 0, 0),
    "unknown parent, then the head: prefix stops at the head": ([v_stored(2, 3), v_stored(0, 1)], 2, 2),
    "removal maps through the table": ([v_stored(0, 1, 2, 3), v_removed(1)], 1, 3),
    "removal of an unknown hash is ignored": ([v_stored(0, 1), BlockRemoved(block_hashes=[7], medium="GPU")], 2, 2),
    "a removed parent's children are not stored again": ([v_stored(0, 1), v_removed(1), v_stored(2)], 1, 1),
    "all cleared empties the table": ([v_stored(0, 1, 2), AllBlocksCleared()], 0, 0),
    "cleared, then stored again": ([v_stored(0, 1, 2), AllBlocksCleared(), v_stored(0)], 1, 1),
    "cached blocks announced again (vLLM re-emits a hit from block 0)": ([v_stored(0, 1), v_stored(0, 1, 2)], 3, 3),
    "another block size than the endpoint's: skipped": ([v_stored(0, 1), v_stored(2, block_size=2,
                                                                                 tokens=TOKENS[8:10])], 2, 2),
    "tokens that do not fill the blocks: skipped": ([v_stored(0, 1, tokens=TOKENS[:7])], 0, 0),
    "extra keys (cache salt, multimodal) from a block on: left out": (
        [v_stored(0, 1, 2, extra_keys=[None, ("salt",), None])], 1, 1),
    "a LoRA's blocks: left out": ([v_stored(0, 1, lora_name="adapter")], 0, 0),
    "another KV-cache group's blocks: left out": ([v_stored(0, 1, group_idx=1)], 0, 0),
}


@pytest.mark.parametrize("events, prefix, table", TRANSLATION.values(), ids=TRANSLATION.keys())
def test_vllm_hashes_are_translated_to_ours(events, prefix, table):
    index = KVIndex()
    for seq, event in enumerate(events):
        index.apply("http://v", seq, [event])
    assert index.prefix_blocks("http://v", H) == prefix
    entry = index.endpoints["http://v"]
    assert len(entry.ours) == table and set(entry.ours.values()) == entry.blocks
    assert not entry.blocks & set(V), "the index holds our hashes only"


def test_a_restart_empties_the_translation_table():
    index = KVIndex()
    index.apply("http://v", 0, [v_stored(0, 1)])
    index.apply("http://v", 0, [v_stored(2)])  # sequence back to 0: a restarted worker; its parent is gone
    assert index.endpoints["http://v"].ours == {} and index.prefix_blocks("http://v", H) == 0


def test_our_workers_events_translate_to_themselves():
    """Our engine announces our hashes: the table maps each to itself, and the prefix is what it announced."""
    from disagg.worker.kv_events.collector import KVEventCollector

    collector = KVEventCollector(BS)
    for i, h in enumerate(H):
        collector.stored(h, H[i - 1] if i else None, TOKENS[i * BS:(i + 1) * BS])
    collector.removed(H[4])
    index = KVIndex()
    index.apply("http://ours", 0, collector.take().events)
    entry = index.endpoints["http://ours"]
    assert entry.ours == {h: h for h in H[:4]} and index.prefix_blocks("http://ours", H) == 4
