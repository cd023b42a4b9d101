"""Paged KV blocks: ref counts, a free list (uncached blocks first, then cached ones in LRU order), and the
prefix cache (block hash -> block id).

Pure bookkeeping; no torch. A freed block keeps its hash (and its KV) until it is reused, so a
later request with the same prefix can take it back from the free list.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol


def hash_block_tokens(parent_hash: bytes | None, token_ids: Iterable[int]) -> bytes:
    """Chain hash of a full block: stable across processes (sha256, not Python's hash())."""
    h = hashlib.sha256(parent_hash or b"")
    h.update(b"".join(int(t).to_bytes(4, "little", signed=False) for t in token_ids))
    return h.digest()


def hash_request_blocks(token_ids: list[int], block_size: int, known: list[bytes]) -> list[bytes]:
    """Extend `known` (hashes of the first len(known) full blocks) to every full block of token_ids."""
    hashes = list(known)
    for start in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        parent = hashes[-1] if hashes else None
        hashes.append(hash_block_tokens(parent, token_ids[start : start + block_size]))
    return hashes


class CacheEventSink(Protocol):
    """Told when a hash enters or leaves the prefix cache (KV-cache events; see worker/kv_events/)."""

    def stored(self, block_hash: bytes, parent_hash: bytes | None, token_ids: Sequence[int]) -> None: ...

    def removed(self, block_hash: bytes) -> None: ...


@dataclass
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None  # set once the block is full and cached


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True, events: CacheEventSink | None = None):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # free blocks in eviction order: first = least recently freed
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[bytes, int] = {}  # block hash -> block id
        self.events = events  # None: nobody listens
        # blocks [0, high_water) have been handed out at least once; never-used blocks sit in the free list
        # in id order behind the reused ones, so they are taken in id order (the KV prefaulter reads this)
        self.high_water = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def usage(self) -> float:
        """Fraction of blocks held by requests (cached-but-free blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_cached_block(self, block_hash: bytes) -> int | None:
        return self._cached.get(block_hash) if self.enable_caching else None

    def get_new_blocks(self, n: int) -> list[int]:
        if n > len(self._free):
            raise ValueError(f"cannot allocate {n} blocks: only {len(self._free)} free")
        ids = []
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            self.uncache_block(block_id)  # evict its cached prefix
            self.blocks[block_id].ref_cnt = 1
            ids.append(block_id)
            if block_id >= self.high_water:
                self.high_water = block_id + 1
        return ids

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take a reference on blocks found in the prefix cache."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_cnt == 0:
                self._free.pop(block_id)
            block.ref_cnt += 1

    def free_blocks(self, block_ids: Iterable[int]) -> None:
        """Drop one reference each. A block reaching zero that holds a cached prefix goes to the end of
        the free list (in this order: least recently used is evicted first); one without goes to the
        front, to be reused first: reusing it evicts nothing, and its memory is already mapped, where
        taking blocks never used yet page-faulted every step's K/V writes (~3.5 ms per layer for a
        4.8k-token prefill on the lazily mapped CPU cache)."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_cnt <= 0:
                raise RuntimeError(f"block {block_id} freed more often than allocated")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block_id] = None
                if block.block_hash is None:
                    self._free.move_to_end(block_id, last=False)

    def cache_block(self, block_id: int, block_hash: bytes, parent_hash: bytes | None = None,
                    token_ids: Sequence[int] = ()) -> None:
        """parent_hash and token_ids (the block's tokens) only go into the stored event."""
        if not self.enable_caching:
            return
        block = self.blocks[block_id]
        if block.block_hash is not None:
            return
        block.block_hash = block_hash
        if block_hash in self._cached:  # a duplicate of a cached block: the hash is already announced
            return
        self._cached[block_hash] = block_id
        if self.events is not None:
            self.events.stored(block_hash, parent_hash, token_ids)

    def uncache_block(self, block_id: int) -> None:
        """Forget a block's hash (its KV is invalid, e.g. a failed remote load, or the block is reused)."""
        block = self.blocks[block_id]
        if block.block_hash is not None and self._cached.get(block.block_hash) == block_id:
            del self._cached[block.block_hash]
            if self.events is not None:
                self.events.removed(block.block_hash)
        block.block_hash = None
