import pytest

from disagg.worker.engine.block_pool import BlockPool, hash_request_blocks
from disagg.worker.engine.kv_cache_manager import KVCacheManager
from disagg.worker.engine.request import Request
from disagg.worker.sampling_params import SamplingParams


def make_req(req_id: str, tokens: list[int]) -> Request:
    return Request(req_id, tokens, SamplingParams(max_tokens=4))


def test_ref_counts_and_free_list_order():
    pool = BlockPool(4)
    a = pool.get_new_blocks(3)
    assert pool.num_free_blocks == 1
    pool.touch([a[0]])  # shared by a second owner
    pool.free_blocks(a)
    assert pool.num_free_blocks == 3  # a[0] still held once
    pool.free_blocks([a[0]])
    assert pool.num_free_blocks == 4
    with pytest.raises(RuntimeError, match="freed more often"):
        pool.free_blocks([a[0]])
    with pytest.raises(ValueError, match="only 4 free"):
        pool.get_new_blocks(5)


def test_hash_chain_depends_on_prefix():
    h1 = hash_request_blocks([1, 2, 3, 4, 5, 6, 7, 8], 4, [])
    h2 = hash_request_blocks([9, 2, 3, 4, 5, 6, 7, 8], 4, [])
    assert len(h1) == 2 and h1[0] != h2[0] and h1[1] != h2[1]  # same second block, other parent
    assert hash_request_blocks([1, 2, 3, 4, 5, 6, 7, 8, 9], 4, h1[:1]) == h1  # extends incrementally


def test_prefix_cache_hit_reuses_freed_blocks_and_leaves_one_token():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    first = make_req("a", list(range(10)))
    assert kv.allocate_slots(first, 10) == [0, 1, 2]
    kv.cache_blocks(first, 10)
    kv.free(first)
    assert kv.num_free_blocks == 8
    second = make_req("b", list(range(8)) + [99, 98])
    hits, n = kv.get_computed_blocks(second)
    assert hits == [0, 1] and n == 8
    exact = make_req("c", list(range(8)))  # whole prompt cached: the last block is recomputed
    hits_exact, n_exact = kv.get_computed_blocks(exact)
    assert hits_exact == [0] and n_exact == 4
    new = kv.allocate_slots(second, 2, hits)
    assert kv.get_block_ids("b")[:2] == [0, 1] and len(new) == 1
    kv.free(second)
    assert kv.num_free_blocks == 8


def test_eviction_drops_hash_so_stale_blocks_are_never_hit():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    a = make_req("a", [1, 2, 3, 4, 5])
    kv.allocate_slots(a, 5)
    kv.cache_blocks(a, 5)
    kv.free(a)
    b = make_req("b", [7, 7, 7, 7, 7, 7, 7, 7])
    kv.allocate_slots(b, 8)  # takes both blocks, evicting a's cached block
    kv.free(b)
    again = make_req("c", [1, 2, 3, 4, 5])
    assert kv.get_computed_blocks(again) == ([], 0)


def test_allocation_failure_changes_nothing():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    a = make_req("a", list(range(12)))
    assert kv.allocate_slots(a, 12) is not None
    b = make_req("b", [1, 2])
    assert kv.allocate_slots(b, 2) is None
    assert kv.get_block_ids("b") == [] and kv.num_free_blocks == 0
    kv.free(a)
    assert kv.num_free_blocks == 3


def test_uncached_blocks_are_reused_first_and_cached_ones_evicted_last():
    pool = BlockPool(8)
    a = pool.get_new_blocks(3)  # 0, 1, 2: never used before, taken in id order
    assert a == [0, 1, 2] and pool.high_water == 3
    pool.cache_block(a[0], b"h0")
    pool.free_blocks(a)  # 1 and 2 hold no cached prefix: reused next; 0 keeps its prefix for a later hit
    b = pool.get_new_blocks(2)
    assert sorted(b) == [1, 2] and pool.high_water == 3  # no fresh block touched, nothing evicted
    assert pool.get_cached_block(b"h0") == 0
    c = pool.get_new_blocks(5)  # then the never-used blocks in id order, and the cached one last
    assert c == [3, 4, 5, 6, 7] and pool.high_water == 8
    assert pool.get_new_blocks(1) == [0] and pool.get_cached_block(b"h0") is None
