"""The router's view of each worker's prefix cache, built from its KV-cache events (pure; no I/O).

Per endpoint: the set of block hashes it announced (BlockStored minus BlockRemoved) and the last sequence number
applied. A sequence that goes back (the worker restarted) or an AllBlocksCleared empties the endpoint's set; a gap
(events lost and not replayed) empties it too, since what was lost may have removed blocks - a stale entry would
predict a hit that is not there (that costs only a recompute, but a cleared entry costs nothing).

Hashes: the router matches a prompt by OUR chain hashes (block_pool.hash_block_tokens over token ids). vLLM's
events carry vLLM's own hashes (seeded, over pickled keys, maybe 64-bit ints), so each endpoint keeps a table
announced hash -> our hash, computed from the parent's translated hash and the block's token ids, which every
BlockStored carries. BlockRemoved maps through the table. For our own workers the translation is the identity
(their hashes are ours; checked in the tests). A block whose parent is unknown (evicted, or announced before we
joined) is left out: a prefix match would stop at its parent anyway. Blocks hashed with extra keys (LoRA,
multimodal, cache salt) or of another KV-cache group are left out too: a plain prompt never hits them. An
endpoint's block size is fixed by its first BlockStored; events of another size (vLLM's partial-block entries)
are skipped, since the router hashes a prompt at one block size per endpoint.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from disagg.worker.engine.block_pool import hash_block_tokens
from disagg.worker.kv_events.schema import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from disagg.worker.kv_events.wire import Applied, sequence_outcome


@dataclass
class EndpointBlocks:
    blocks: set[bytes] = field(default_factory=set)  # our hashes of the blocks the worker holds
    ours: dict[bytes | int, bytes] = field(default_factory=dict)  # its announced hash -> our hash
    last_seq: int | None = None  # None: nothing applied yet
    block_size: int | None = None  # from its first BlockStored
    skipped: int = 0  # blocks announced that could not be translated (unknown parent, other size, extra keys)

    def clear(self) -> None:
        self.blocks.clear()
        self.ours.clear()


@dataclass
class KVIndex:
    endpoints: dict[str, EndpointBlocks] = field(default_factory=dict)  # url -> its blocks

    def apply(self, url: str, seq: int, events: Iterable[KVCacheEvent], replayed: bool = False) -> tuple[Applied, int]:
        """Apply one batch of `url`'s events; returns how, and how many batches were lost before it.
        replayed: the batch came from the replay socket, where a sequence at or below the last one is a
        duplicate rather than a restart."""
        entry = self.endpoints.setdefault(url, EndpointBlocks())
        outcome, lost = sequence_outcome(seq, entry.last_seq, replayed)
        if outcome is Applied.DUPLICATE:
            return outcome, lost
        if outcome is not Applied.IN_ORDER:  # a restart, or a gap whose lost batches may have removed blocks
            entry.clear()
        entry.last_seq = seq
        for event in events:
            _apply_event(entry, event)
        return outcome, lost

    def drop(self, url: str) -> None:
        """The endpoint is gone (or unready): forget it; a new subscription starts over."""
        self.endpoints.pop(url, None)

    def last_seq(self, url: str) -> int | None:
        entry = self.endpoints.get(url)
        return entry.last_seq if entry else None

    def prefix_blocks(self, url: str, block_hashes: list[bytes]) -> int:
        """How many leading blocks of a prompt (its chain hashes) the endpoint holds."""
        entry = self.endpoints.get(url)
        if entry is None:
            return 0
        n = 0
        for h in block_hashes:
            if h not in entry.blocks:
                break
            n += 1
        return n

    def block_size(self, url: str) -> int | None:
        entry = self.endpoints.get(url)
        return entry.block_size if entry else None


def _apply_event(entry: EndpointBlocks, event: KVCacheEvent) -> None:
    if isinstance(event, BlockStored):
        _store(entry, event)
    elif isinstance(event, BlockRemoved):
        if event.group_idx not in (None, 0):
            return
        for h in event.block_hashes:
            ours = entry.ours.pop(h, None)
            if ours is not None:
                entry.blocks.discard(ours)
    elif isinstance(event, AllBlocksCleared):
        entry.clear()


def _store(entry: EndpointBlocks, event: BlockStored) -> None:
    n, bs = len(event.block_hashes), event.block_size
    if entry.block_size is None and bs > 0:
        entry.block_size = bs
    plain = event.lora_name is None and event.lora_id is None and event.group_idx in (None, 0)
    if not plain or bs != entry.block_size or len(event.token_ids) != n * bs:
        entry.skipped += n
        return
    if event.parent_block_hash is None:
        parent = None
    elif (parent := entry.ours.get(event.parent_block_hash)) is None:
        entry.skipped += n  # its parent is not held (or not known): no prefix reaches these blocks
        return
    extra = event.extra_keys or [None] * n
    for i, h in enumerate(event.block_hashes):
        if i < len(extra) and extra[i] is not None:
            entry.skipped += n - i  # hashed with more than token ids: neither it nor its children match
            return
        parent = hash_block_tokens(parent, event.token_ids[i * bs:(i + 1) * bs])
        entry.ours[h] = parent
        entry.blocks.add(parent)
