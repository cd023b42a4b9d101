"""Per-request block tables on top of the BlockPool, with prefix-cache lookups."""
from __future__ import annotations

from disagg.worker.engine.block_pool import BlockPool, CacheEventSink, hash_request_blocks
from disagg.worker.engine.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 events: CacheEventSink | None = None):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching, events=events)
        self.req_to_blocks: dict[str, list[int]] = {}  # req_id -> block table
        self._num_cached_blocks: dict[str, int] = {}  # req_id -> leading blocks already in the prefix cache

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def usage(self) -> float:
        return self.pool.usage()

    def get_block_ids(self, req_id: str) -> list[int]:
        return self.req_to_blocks.get(req_id, [])

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Longest cached prefix of the request, in blocks, leaving at least one token to compute
        (its logits are needed). Takes no reference yet."""
        if not self.pool.enable_caching:
            return [], 0
        request.block_hashes = hash_request_blocks(request.all_token_ids, self.block_size, request.block_hashes)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[int] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block_id = self.pool.get_cached_block(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        return hits, len(hits) * self.block_size

    def allocate_slots(
        self, request: Request, num_new_tokens: int, new_computed_blocks: list[int] | None = None
    ) -> list[int] | None:
        """Make room for `num_new_tokens` beyond request.num_computed_tokens (plus the prefix-hit
        blocks, which come first). Returns the newly allocated block ids, or None (nothing changed)
        when the pool is short."""
        new_computed_blocks = new_computed_blocks or []
        table = self.req_to_blocks.get(request.request_id, [])
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        needed = cdiv(num_computed + num_new_tokens, self.block_size) - len(table) - len(new_computed_blocks)
        # prefix-hit blocks sitting in the free list are taken out of it by touch()
        reusable_free = sum(1 for b in new_computed_blocks if self.pool.blocks[b].ref_cnt == 0)
        if max(needed, 0) > self.pool.num_free_blocks - reusable_free:
            return None
        self.pool.touch(new_computed_blocks)
        new_blocks = self.pool.get_new_blocks(max(needed, 0))
        table = self.req_to_blocks.setdefault(request.request_id, table)
        table.extend(new_computed_blocks)
        table.extend(new_blocks)
        if new_computed_blocks:
            self._num_cached_blocks[request.request_id] = len(table) - len(new_blocks)
        return new_blocks

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Register the request's full blocks whose KV is computed in the prefix cache."""
        if not self.pool.enable_caching:
            return
        table = self.req_to_blocks.get(request.request_id, [])
        num_full = min(num_computed_tokens // self.block_size, len(table))
        start = self._num_cached_blocks.get(request.request_id, 0)
        if num_full <= start:
            return
        request.block_hashes = hash_request_blocks(request.all_token_ids, self.block_size, request.block_hashes)
        bs, tokens, hashes = self.block_size, request.all_token_ids, request.block_hashes
        for i in range(start, num_full):
            self.pool.cache_block(table[i], hashes[i], hashes[i - 1] if i else None, tokens[i * bs : (i + 1) * bs])
        self._num_cached_blocks[request.request_id] = num_full

    def uncache_blocks(self, block_ids: set[int]) -> None:
        for block_id in block_ids:
            self.pool.uncache_block(block_id)

    def free(self, request: Request) -> None:
        """Release the request's blocks; tail blocks first go to the free list first (they are the
        least likely to be shared by a later prefix)."""
        table = self.req_to_blocks.pop(request.request_id, [])
        self._num_cached_blocks.pop(request.request_id, None)
        self.pool.free_blocks(reversed(table))
