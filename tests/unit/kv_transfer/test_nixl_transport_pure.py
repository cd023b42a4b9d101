"""The pure decisions under the NIXL transport: coalescing, block-id checks, compatibility."""
from __future__ import annotations

import dataclasses

import pytest

from disagg.worker.kv_transfer.base import KVCacheSpec
from disagg.worker.kv_transfer.nixl_metrics import NixlTransferStats, merge_stats
from disagg.worker.kv_transfer.nixl_checks import (
    IncompatiblePeer,
    InvalidBlockIds,
    check_block_ids,
    check_compatible,
    coalesce,
)
from disagg.worker.kv_transfer.side_channel import KV_LAYOUT, EngineMetadata, compat_fields, compat_hash


@pytest.mark.parametrize(
    "local, remote, runs",
    [
        ([], [], []),
        ([3], [7], [(3, 7, 1)]),
        ([0, 1, 2, 3], [10, 11, 12, 13], [(0, 10, 4)]),  # both consecutive: one run
        ([0, 1, 2, 3], [10, 11, 20, 21], [(0, 10, 2), (2, 20, 2)]),  # remote breaks
        ([0, 1, 5, 6], [10, 11, 12, 13], [(0, 10, 2), (5, 12, 2)]),  # local breaks
        ([0, 2, 4], [1, 3, 5], [(0, 1, 1), (2, 3, 1), (4, 5, 1)]),  # every other block
        ([3, 2, 1], [6, 5, 4], [(3, 6, 1), (2, 5, 1), (1, 4, 1)]),  # descending is not a run
        ([5, 6, 0, 1], [0, 1, 2, 3], [(5, 0, 2), (0, 2, 2)]),  # order is kept
        ([0, 1, 2, 9, 10, 4], [8, 9, 10, 0, 1, 30], [(0, 8, 3), (9, 0, 2), (4, 30, 1)]),
    ],
)
def test_coalesce(local, remote, runs):
    assert coalesce(local, remote) == runs
    # the runs cover exactly the input pairs, in order
    assert [(lo + i, ro + i) for lo, ro, n in runs for i in range(n)] == list(zip(local, remote))


def test_coalesce_length_mismatch():
    with pytest.raises(InvalidBlockIds, match="3 local block ids but 2 remote"):
        coalesce([1, 2, 3], [1, 2])


@pytest.mark.parametrize(
    "ids, message",
    [
        ([-1, 0, 1], r"out of range \[0, 8\): \[-1\]"),
        ([0, 8, 9], r"out of range \[0, 8\): \[8, 9\]"),
        ([1, 2, 1, 3, 2], r"duplicated: \[1, 2\]"),
        ([7, 7, 100], r"out of range \[0, 8\): \[100\]; duplicated: \[7\]"),
    ],
)
def test_check_block_ids_names_bad_ids(ids, message):
    with pytest.raises(InvalidBlockIds, match=message):
        check_block_ids(ids, 8, "peer X")


def test_check_block_ids_accepts_valid():
    check_block_ids([], 8, "x")
    check_block_ids([7, 0, 3], 8, "x")


SPEC = KVCacheSpec(model_name="m", num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, num_blocks=16,
                   dtype="float16")


def metadata(engine_id: str = "A", **changes) -> EngineMetadata:
    fields = compat_fields(SPEC.model_name, SPEC.dtype, SPEC.num_layers, SPEC.num_kv_heads, SPEC.head_dim,
                           SPEC.block_size, KV_LAYOUT)
    fields.update(changes)
    return EngineMetadata(engine_id=engine_id, agent_name=engine_id, agent_metadata=b"\x00md", kv_base_addr=4096,
                          bytes_per_block=SPEC.bytes_per_block, num_blocks=SPEC.num_blocks, device_kind="DRAM",
                          device_id=0, compat=fields, compat_hash=compat_hash(fields))


def test_compatible_peer_passes():
    check_compatible(metadata("A"), metadata("B"))
    # num_blocks and device kind may differ between engines
    check_compatible(metadata("A"), dataclasses.replace(metadata("B"), num_blocks=3, device_kind="VRAM"))


@pytest.mark.parametrize(
    "field_name, value",
    [
        ("model_name", "other-model"),
        ("dtype", "bfloat16"),
        ("num_layers", 3),
        ("num_kv_heads", 4),
        ("head_dim", 16),
        ("block_size", 16),
        ("layout", "layers,blocks,kv,block_size,kv_heads,head_dim"),
        ("protocol_version", 2),
    ],
)
def test_each_compat_field_mismatch_is_named(field_name, value):
    local, peer = metadata("A"), metadata("B", **{field_name: value})
    assert peer.compat_hash != local.compat_hash
    with pytest.raises(IncompatiblePeer) as exc:
        check_compatible(local, peer)
    text = str(exc.value)
    assert local.compat_hash in text and peer.compat_hash in text
    assert f"{field_name} (local {local.compat[field_name]!r}, peer {value!r})" in text
    assert "peer engine B" in text


def test_compat_hash_must_match_the_fields():
    forged = dataclasses.replace(metadata("B", dtype="bfloat16"), compat_hash=metadata("A").compat_hash)
    with pytest.raises(IncompatiblePeer, match="does not match its own fields"):
        check_compatible(metadata("A"), forged)


def test_bytes_per_block_mismatch():
    with pytest.raises(IncompatiblePeer, match="bytes_per_block 1 != local 512"):
        check_compatible(metadata("A"), dataclasses.replace(metadata("B"), bytes_per_block=1))


def test_compat_hash_is_stable_and_order_free():
    fields = metadata().compat
    assert compat_hash(fields) == compat_hash(dict(reversed(list(fields.items()))))
    assert len(compat_hash(fields)) == 16


def test_stats_drain_resets_and_merges():
    stats = NixlTransferStats()
    assert stats.is_empty()
    stats.record_done(0.5, 0.01, 1024, 2)
    stats.record_failed()
    first = stats.drain()
    assert first == {"xfer_time_s": [0.5], "post_time_s": [0.01], "bytes": [1024], "num_descriptors": [2],
                     "num_failed_transfers": 1}
    assert stats.is_empty()
    stats.record_done(0.25, 0.02, 512, 1)
    merged = merge_stats(first, stats.drain())
    assert merged["bytes"] == [1024, 512] and merged["num_failed_transfers"] == 1
    assert merge_stats(None, first) is first
