"""NIXL READs between two real processes on loopback.

Process A (kv_owner_process.py, a child) owns a patterned KV tensor, serves the side channel and
polls notifications; process B (this pytest process) fetches the metadata and reads blocks.
"""
from __future__ import annotations

import threading
import time
import uuid

import pytest
import torch

pytest.importorskip("nixl")

from kv_owner_process import OwnerProcess, make_kv, make_spec  # noqa: E402

from disagg.worker.kv_transfer.nixl_transport import (  # noqa: E402
    IncompatiblePeer,
    NixlTransport,
    TransferFailed,
    TransferState,
    UnknownPeer,
    coalesce,
)
from disagg.worker.kv_transfer.side_channel import SideChannelUnreachable, fetch_engine_metadata  # noqa: E402

pytestmark = pytest.mark.slow
HOST = "127.0.0.1"
READ_TIMEOUT_S = 5.0


@pytest.fixture
def owners():
    started: list[OwnerProcess] = []

    def start(engine_id: str, *args: str) -> tuple[OwnerProcess, dict]:
        owner = OwnerProcess(engine_id, *args, lifetime=60.0)
        started.append(owner)
        return owner, owner.wait_ready()

    yield start
    for owner in started:
        owner.stop()


@pytest.fixture
def reader():
    made: list[NixlTransport] = []

    def make(num_blocks: int = 48, **spec_changes) -> tuple[NixlTransport, torch.Tensor]:
        spec = make_spec(num_blocks=num_blocks, **spec_changes)
        kv = make_kv(spec, None)
        transport = NixlTransport(f"B-{uuid.uuid4().hex[:8]}", spec, kv)
        transport.register()
        made.append(transport)
        return transport, kv

    yield make
    for transport in made:
        transport.close()


def wait_done(transport: NixlTransport, handle, timeout: float = READ_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while transport.poll(handle) is not TransferState.DONE:
        assert time.monotonic() < deadline, f"read not done within {timeout}s"


def assert_blocks_equal(kv: torch.Tensor, local_ids, expected_kv: torch.Tensor, remote_ids) -> None:
    assert torch.equal(kv[local_ids].view(torch.int16), expected_kv[remote_ids].view(torch.int16))


def test_read_scattered_blocks_and_notify(owners, reader):
    owner, ready = owners("A-read", "--seed", "7")
    b, kv = reader()
    b.add_peer(fetch_engine_metadata(HOST, ready["port"], timeout=5.0))
    local = [0, 1, 2, 3, 10, 20, 21, 30, 47]
    remote = [5, 6, 7, 8, 60, 12, 13, 0, 33]
    runs = coalesce(local, remote)
    assert len(runs) == 5

    handle = b.start_read("A-read", local, remote, b"req-1:done")
    wait_done(b, handle)

    expected = make_kv(make_spec(num_blocks=64), seed=7)
    assert_blocks_equal(kv, local, expected, remote)
    untouched = [i for i in range(48) if i not in local]
    assert not kv[untouched].any(), "blocks outside the read were written"
    assert owner.wait_notifs(1) == [(b.agent_name, b"req-1:done")]
    stats = b.drain_stats()
    assert stats["num_descriptors"] == [len(runs)]
    assert stats["bytes"] == [len(local) * b.spec.bytes_per_block]
    assert stats["num_failed_transfers"] == 0 and len(stats["xfer_time_s"]) == 1
    assert b.num_inflight == 0

    # the same peer again (cached, no re-add): one contiguous run is one descriptor
    assert b.add_peer(fetch_engine_metadata(HOST, ready["port"], timeout=5.0)) == ready["agent_name"]
    wait_done(b, b.start_read("A-read", list(range(32, 40)), list(range(50, 58)), b"req-2"))
    assert_blocks_equal(kv, list(range(32, 40)), expected, list(range(50, 58)))
    assert b.drain_stats()["num_descriptors"] == [1]
    assert owner.wait_notifs(2)[1] == (b.agent_name, b"req-2")


def test_notify_reaches_a_fresh_peer_without_moving_kv(owners, reader):
    """A full local prefix hit only has to release the sender: the message must arrive even though the
    reader makes no progress once its handle is DONE (an idle decode engine), and it moves no KV."""
    owner, ready = owners("A-notify", "--seed", "3")
    b, kv = reader()
    b.add_peer(fetch_engine_metadata(HOST, ready["port"], timeout=5.0))  # a fresh connection, not wired up yet
    wait_done(b, b.notify("A-notify", b"req-9:cached"))
    assert owner.wait_notifs(1) == [(b.agent_name, b"req-9:cached")]
    assert not kv.any(), "a notification wrote KV"
    stats = b.drain_stats()
    assert stats["bytes"] == [] and stats["num_failed_transfers"] == 0, "a notification is not a KV transfer"
    assert b.num_inflight == 0
    with pytest.raises(UnknownPeer, match="'A-other' not added"):
        b.notify("A-other", b"x")

    owner.kill()  # a dead peer: the notification fails like a read does, naming what it was
    t0 = time.monotonic()
    with pytest.raises(TransferFailed, match="notification to peer A-notify .*req-10"):
        while time.monotonic() - t0 < READ_TIMEOUT_S:
            wait_done(b, b.notify("A-notify", b"req-10"))
    assert not b.has_peer("A-notify") and b.num_inflight == 0


def test_incompatible_peer_is_refused_without_transfer(owners, reader):
    owner, ready = owners("A-bf16", "--dtype", "bfloat16")
    b, kv = reader()  # float16
    md = fetch_engine_metadata(HOST, ready["port"], timeout=5.0)
    with pytest.raises(IncompatiblePeer) as exc:
        b.add_peer(md)
    assert "dtype (local 'float16', peer 'bfloat16')" in str(exc.value)
    assert md.compat_hash in str(exc.value) and b.local_metadata().compat_hash in str(exc.value)
    assert not b.has_peer("A-bf16")
    with pytest.raises(UnknownPeer, match="'A-bf16' not added"):
        b.start_read("A-bf16", [0], [0], b"never")
    assert owner.wait_notifs(1, timeout=0.3) == []
    assert not kv.any()


def read_until_failure(b: NixlTransport, peer: str, deadline: float) -> TransferFailed:
    """Read all blocks again and again until a read fails; returns that failure."""
    ids = list(range(b.spec.num_blocks))
    while time.monotonic() < deadline:
        try:
            handle = b.start_read(peer, ids, ids, b"loop")
            while b.poll(handle) is not TransferState.DONE:
                assert time.monotonic() < deadline, "a read hung after its peer died"
        except TransferFailed as e:
            return e
    raise AssertionError("no read failed after the peer was killed")


def test_peer_killed_then_restarted(owners, reader):
    owner, ready = owners("A-crash", "--seed", "1")
    b, kv = reader()
    b.add_peer(fetch_engine_metadata(HOST, ready["port"], timeout=5.0))
    old_md = b._peers["A-crash"].metadata
    wait_done(b, b.start_read("A-crash", [0, 1], [2, 3], b"warm"))  # connection established

    # killed before the read: the failure surfaces from start_read or the first polls, quickly
    owner.kill()
    t0 = time.monotonic()
    failure = read_until_failure(b, "A-crash", deadline=t0 + READ_TIMEOUT_S)
    assert time.monotonic() - t0 < 2.0
    assert failure.peer_engine_id == "A-crash" and failure.cause is not None
    assert failure.local_block_ids == list(range(48))  # the caller marks these invalid
    assert "A-crash" in str(failure) and "loop" in str(failure)
    assert b.num_inflight == 0
    assert not b.has_peer("A-crash")
    with pytest.raises(UnknownPeer, match="failed; fetch its metadata"):
        b.start_read("A-crash", [0], [0], b"x")
    with pytest.raises(SideChannelUnreachable, match="connection refused"):
        fetch_engine_metadata(HOST, ready["port"], timeout=1.0)
    assert b.drain_stats()["num_failed_transfers"] == 1

    # restarted under the same engine id: new agent metadata, new data; B re-adds and reads
    owner2, ready2 = owners("A-crash", "--seed", "2")
    md2 = fetch_engine_metadata(HOST, ready2["port"], timeout=5.0)
    assert md2.agent_metadata != old_md.agent_metadata
    b.add_peer(md2)
    assert b.has_peer("A-crash")
    handle = b.start_read("A-crash", [5, 6, 9], [10, 11, 40], b"after-restart")
    wait_done(b, handle)
    assert_blocks_equal(kv, [5, 6, 9], make_kv(make_spec(num_blocks=64), seed=2), [10, 11, 40])
    assert owner2.wait_notifs(1) == [(b.agent_name, b"after-restart")]


def test_peer_killed_while_reading(owners, reader):
    # 64 KiB blocks, 48 of them: each read moves 3 MiB, so the kill often lands mid-read
    owner, ready = owners("A-midread", "--num-layers", "128")
    b, _ = reader(num_layers=128)
    b.add_peer(fetch_engine_metadata(HOST, ready["port"], timeout=5.0))
    killed_at: list[float] = []

    def kill_soon() -> None:
        owner.kill()
        killed_at.append(time.monotonic())

    killer = threading.Timer(0.3, kill_soon)
    killer.start()
    try:
        failure = read_until_failure(b, "A-midread", deadline=time.monotonic() + READ_TIMEOUT_S)
    finally:
        killer.join(timeout=15)
    assert killed_at and time.monotonic() - killed_at[0] < 2.0
    assert failure.cause is not None
    assert b.num_inflight == 0
    stats = b.drain_stats()
    assert stats["num_failed_transfers"] == 1 and len(stats["bytes"]) >= 1
