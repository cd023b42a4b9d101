"""NIXL transport: registers this engine's KV tensor and READs blocks from peers' KV tensors.

The connector (nixl.py) decides *which* blocks move and *when*; this module only moves bytes:

    owner (prefill)                          reader (decode)
    t = NixlTransport(eid, spec, kv); t.register()
    SideChannelServer(t.local_metadata())    md = fetch_engine_metadata(host, port)
                                             r.add_peer(md)
                                             h = r.start_read(eid, local_ids, remote_ids, b"req-1")
    t.get_new_notifs() -> [(agent, b"req-1")]   r.poll(h) -> PROC ... DONE | raises TransferFailed
                                             h = r.notify(eid, b"req-2")  (no KV moves; poll(h) the same way)

The agent runs without NIXL's progress thread (it burns a core even when idle): progress happens
only inside our calls, so the owner must call get_new_notifs() and the reader poll() regularly.
Not thread-safe: call every method from one thread (the connector's progress thread, nixl_progress.py).

Because the KV tensor is block-major, consecutive block ids are one byte range, and a read is
posted as one descriptor per run where both the local and the remote ids are consecutive.

The checks a READ must pass before it is posted (block ids, peer compatibility) and the errors are
pure, in nixl_checks.py. Over 300 lines: what is left is one adapter over nixl's agent (memory, peers,
transfers, cleanup), whose release rules (a dlist outlives its xfer; failed releases retried at close)
must be read together.
"""
from __future__ import annotations

import enum
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from disagg.worker.kv_transfer.base import KVCacheSpec
from disagg.worker.kv_transfer.nixl_checks import (
    IncompatiblePeer,
    InvalidBlockIds,
    NixlTransportError,
    TransferFailed,
    UnknownPeer,
    check_block_ids,
    check_compatible,
    coalesce,
)
from disagg.worker.kv_transfer.nixl_metrics import NixlTransferStats
from disagg.worker.kv_transfer.side_channel import KV_LAYOUT, EngineMetadata, compat_hash, spec_compat_fields

logger = logging.getLogger(__name__)

_LOCAL_SIDE = "NIXL_INIT_AGENT"  # prep_xfer_dlist's name for "my own registered memory"
_SCRATCH_BYTES = 64  # registered beside the KV tensor: the destination of notify()'s one-byte read


class TransferState(enum.Enum):
    """A posted transfer's state; nixl's own strings ("PROC", "DONE", "ERR") stay inside this module."""

    PROC = "PROC"  # posted, not finished
    DONE = "DONE"  # finished; its nixl handles are released
    FAILED = "FAILED"  # raised TransferFailed; its local blocks may be partly written


@dataclass
class _Peer:
    metadata: EngineMetadata
    agent_name: str  # as add_remote_agent returned it
    stale: bool = False  # a transfer to it failed: re-add on the next add_peer even if metadata is equal


@dataclass(eq=False)  # hashed by identity: lives in a set of in-flight reads
class ReadHandle:
    peer_engine_id: str
    local_block_ids: list[int]
    remote_block_ids: list[int]
    notif_msg: bytes
    num_descriptors: int  # coalesced runs
    nbytes: int
    state: TransferState = TransferState.PROC
    control: bool = False  # notify(): carries a message, moves no KV (not counted as a transfer)
    error: TransferFailed | None = None
    post_time_s: float = 0.0
    posted_at: float = 0.0  # time.monotonic() at post (what read timeouts count from)
    _t_post: float = 0.0  # perf_counter at post
    _nixl: list[Any] = field(default_factory=list)  # xfer + dlist handles, released when finished


class NixlTransport:
    def __init__(self, engine_id: str, spec: KVCacheSpec, kv_cache: Any, *, agent_name: str | None = None,
                 backends: Sequence[str] = ("UCX",), num_threads: int = 0):
        from nixl._api import nixl_agent, nixl_agent_config  # optional dependency: import only when used

        _check_kv_tensor(spec, kv_cache)
        self.engine_id = engine_id
        self.spec = spec
        self.kv_cache = kv_cache  # keeps the registered memory alive
        self.device_kind = "VRAM" if kv_cache.is_cuda else "DRAM"
        self.device_id = (kv_cache.device.index or 0) if kv_cache.is_cuda else 0
        self.agent_name = agent_name or engine_id
        # no progress thread: it burns a core even when idle; our calls drive progress instead
        config = nixl_agent_config(enable_prog_thread=False, backends=list(backends), num_threads=num_threads)
        self._agent: Any = nixl_agent(self.agent_name, config)
        self._reg_descs: Any = None
        self._scratch: Any = None  # torch tensor beside the KV tensor, same device
        self._metadata: EngineMetadata | None = None
        self._peers: dict[str, _Peer] = {}  # engine_id -> peer
        self._inflight: set[ReadHandle] = set()
        self._unreleased: list[Any] = []  # nixl handles whose release raised; retried at close()
        self._stats = NixlTransferStats()
        self._closed = False

    # -------- memory and metadata
    def register(self) -> None:
        """Register the whole KV tensor once (idempotent)."""
        if self._reg_descs is not None:
            return
        import torch

        self._scratch = torch.zeros(_SCRATCH_BYTES, dtype=torch.uint8, device=self.kv_cache.device)
        regions = [(self.kv_cache.data_ptr(), self._nbytes(), self.device_id, ""),
                   (self._scratch.data_ptr(), _SCRATCH_BYTES, self.device_id, "")]
        self._reg_descs = self._agent.register_memory(regions, self.device_kind)
        fields = spec_compat_fields(self.spec)
        self._metadata = EngineMetadata(
            engine_id=self.engine_id, agent_name=self.agent_name,
            agent_metadata=self._agent.get_agent_metadata(),  # after registration: it carries the region
            kv_base_addr=self.kv_cache.data_ptr(), bytes_per_block=self.spec.bytes_per_block,
            num_blocks=self.spec.num_blocks, device_kind=self.device_kind, device_id=self.device_id,
            compat=fields, compat_hash=compat_hash(fields),
        )

    def local_metadata(self) -> EngineMetadata:
        if self._metadata is None:
            raise NixlTransportError(f"engine {self.engine_id}: register() before local_metadata()")
        return self._metadata

    # -------- peers
    def add_peer(self, metadata: EngineMetadata) -> str:
        """Check compatibility and load the peer's agent; returns its agent name.

        Same metadata as cached -> no-op. Changed agent metadata (the peer restarted) or a failed
        transfer since the last add -> remove the old agent and load the new one."""
        check_compatible(self.local_metadata(), metadata)
        if metadata.agent_name == self.agent_name:
            raise IncompatiblePeer(f"peer engine {metadata.engine_id} uses our own agent name {self.agent_name!r}")
        peer = self._peers.get(metadata.engine_id)
        if peer is not None:
            if not peer.stale and peer.metadata.agent_metadata == metadata.agent_metadata:
                return peer.agent_name
            self.remove_peer(metadata.engine_id)
        name = self._agent.add_remote_agent(metadata.agent_metadata)
        name = name.decode() if isinstance(name, bytes) else name  # 1.5.1 returns bytes
        self._peers[metadata.engine_id] = _Peer(metadata, name)
        logger.info("engine %s: added peer %s (agent %s)", self.engine_id, metadata.engine_id, name)
        return name

    def has_peer(self, engine_id: str) -> bool:
        """False when unknown or when a transfer to it failed: fetch its metadata and add_peer again."""
        peer = self._peers.get(engine_id)
        return peer is not None and not peer.stale

    def remove_peer(self, engine_id: str) -> None:
        """Fail this peer's in-flight reads and unload its agent (no-op when unknown)."""
        peer = self._peers.pop(engine_id, None)
        if peer is None:
            return
        for handle in [h for h in self._inflight if h.peer_engine_id == engine_id]:
            self._fail(handle, None, "peer removed before the read finished")
        try:
            self._agent.remove_remote_agent(peer.agent_name)
        except Exception:  # a dead peer's agent may refuse; it is forgotten either way
            logger.warning("engine %s: remove_remote_agent(%s) failed", self.engine_id, peer.agent_name, exc_info=True)

    @property
    def num_inflight(self) -> int:
        """Reads posted and not yet DONE, failed or released."""
        return len(self._inflight)

    def validate_remote_blocks(self, peer_engine_id: str, block_ids: Sequence[int]) -> None:
        check_block_ids(block_ids, self._peer(peer_engine_id).metadata.num_blocks, f"peer {peer_engine_id}")

    # -------- transfers
    def start_read(self, peer_engine_id: str, local_block_ids: Sequence[int], remote_block_ids: Sequence[int],
                   notif_msg: bytes = b"") -> ReadHandle:
        """Post a READ of remote blocks into local blocks; the peer gets notif_msg when it is done.

        Raises InvalidBlockIds / UnknownPeer before anything is posted, TransferFailed after."""
        peer = self._peer(peer_engine_id)
        if not local_block_ids:
            raise InvalidBlockIds("no blocks to read (use notify() to only send the peer a message)")
        check_block_ids(local_block_ids, self.spec.num_blocks, f"local (engine {self.engine_id})")
        self.validate_remote_blocks(peer_engine_id, remote_block_ids)
        runs = coalesce(local_block_ids, remote_block_ids)
        bpb, rmd = self.spec.bytes_per_block, peer.metadata
        local_descs = [(self.kv_cache.data_ptr() + lo * bpb, n * bpb, self.device_id) for lo, _, n in runs]
        remote_descs = [(rmd.kv_base_addr + ro * bpb, n * bpb, rmd.device_id) for _, ro, n in runs]
        handle = ReadHandle(peer_engine_id, list(local_block_ids), list(remote_block_ids), notif_msg,
                            num_descriptors=len(runs), nbytes=len(local_block_ids) * bpb)
        return self._post(handle, peer, local_descs, remote_descs)

    def notify(self, peer_engine_id: str, msg: bytes) -> ReadHandle:
        """Send a peer a message without moving KV (e.g. every block was already cached here); poll() the
        handle like a read: DONE once the message has gone out.

        nixl's send_notif() is fire-and-forget: when it cannot go out at once (a fresh connection still
        wiring up) it only leaves while this agent makes progress, which stops when the engine goes idle -
        the peer would then hold its blocks until the lease runs out. So the message rides, as a READ's
        notification, on a one-byte read of the peer's registered region into a local scratch byte (its value
        is never used, so racing with the peer's own writes there is harmless)."""
        if not msg:
            raise ValueError("notify() needs a message")
        peer = self._peer(peer_engine_id)
        rmd = peer.metadata
        handle = ReadHandle(peer_engine_id, [], [], msg, num_descriptors=1, nbytes=1, control=True)
        return self._post(handle, peer, [(self._scratch.data_ptr(), 1, self.device_id)],
                          [(rmd.kv_base_addr, 1, rmd.device_id)])

    def _post(self, handle: ReadHandle, peer: _Peer, local_descs: list, remote_descs: list) -> ReadHandle:
        rmd = peer.metadata
        t0 = time.perf_counter()
        try:
            local = self._agent.prep_xfer_dlist(_LOCAL_SIDE, local_descs, self.device_kind)
            handle._nixl.append(local)
            remote = self._agent.prep_xfer_dlist(peer.agent_name, remote_descs, rmd.device_kind)
            handle._nixl.append(remote)
            indices = list(range(len(local_descs)))
            xfer = self._agent.make_prepped_xfer("READ", local, indices, remote, indices, handle.notif_msg)
            handle._nixl.insert(0, xfer)  # released first: a dlist must outlive the xfer made from it
            self._inflight.add(handle)
            handle.posted_at = time.monotonic()
            handle._t_post = time.perf_counter()
            state = self._agent.transfer(xfer)
        except Exception as e:  # the 12 nixl error classes share no base but Exception
            raise self._fail(handle, e, "posting the READ failed") from e
        handle.post_time_s = time.perf_counter() - t0
        self._after_state(handle, state)
        return handle

    def poll(self, handle: ReadHandle) -> TransferState:
        """PROC or DONE (handles released on DONE); raises TransferFailed (handles released)."""
        if handle.state is TransferState.DONE:
            return TransferState.DONE
        if handle.error is not None:
            raise handle.error
        try:
            state = self._agent.check_xfer_state(handle._nixl[0])
        except Exception as e:
            raise self._fail(handle, e, "the READ failed") from e
        self._after_state(handle, state)
        return handle.state

    def abandon(self, handle: ReadHandle, why: str) -> TransferFailed:
        """Give up on an unfinished READ (the peer stopped answering): its handles are released and the
        peer's agent is unloaded, which disconnects its endpoint and so cancels whatever UCX still has
        outstanding on it - nothing can land in the local blocks afterwards, and the next add_peer()
        loads a fresh agent (a stale one is what makes later transfers fail or hang). Returns the error;
        the local blocks must be treated as invalid."""
        if handle.state is not TransferState.PROC:
            return handle.error or TransferFailed(
                f"engine {self.engine_id}: abandoning a finished transfer", peer_engine_id=handle.peer_engine_id,
                local_block_ids=handle.local_block_ids, remote_block_ids=handle.remote_block_ids,
                notif_msg=handle.notif_msg, cause=None)
        error = self._fail(handle, None, f"abandoned: {why}")
        self.remove_peer(handle.peer_engine_id)
        self._retry_unreleased()
        return error

    def count_failed(self) -> None:
        """Count a finished READ whose blocks the caller had to discard (e.g. it ended past the sender's lease)."""
        self._stats.record_failed()

    def get_new_notifs(self) -> list[tuple[str, bytes]]:
        """(peer agent name, message) received since the last call; also drives progress."""
        notifs = self._agent.get_new_notifs()
        return [(name, msg) for name, msgs in notifs.items() for msg in msgs]

    def drain_stats(self) -> dict[str, Any]:
        return self._stats.drain()

    def close(self) -> None:
        """Abandon in-flight reads, unload peers, deregister memory, drop the agent (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for handle in list(self._inflight):
            self._fail(handle, None, "transport closed", count=False)
        for engine_id in list(self._peers):
            self.remove_peer(engine_id)
        self._retry_unreleased(final=True)
        if self._reg_descs is not None:
            self._agent.deregister_memory(self._reg_descs)
            self._reg_descs = None
        self._agent = None

    def __enter__(self) -> "NixlTransport":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -------- internals
    def _peer(self, engine_id: str) -> _Peer:
        peer = self._peers.get(engine_id)
        if peer is None:
            raise UnknownPeer(f"engine {self.engine_id}: peer {engine_id!r} not added (known: {sorted(self._peers)})")
        if peer.stale:
            raise UnknownPeer(f"engine {self.engine_id}: a transfer from peer {engine_id!r} failed; "
                              "fetch its metadata and add_peer() again")
        return peer

    def _nbytes(self) -> int:
        return self.kv_cache.numel() * self.kv_cache.element_size()

    def _after_state(self, handle: ReadHandle, state: str) -> None:
        """Apply nixl's state string for the handle (from transfer() or check_xfer_state())."""
        if state == "DONE":
            xfer_time = time.perf_counter() - handle._t_post
            handle.state = TransferState.DONE
            self._release_handles(handle)
            if not handle.control:
                self._stats.record_done(xfer_time, handle.post_time_s, handle.nbytes, handle.num_descriptors)
        elif state != "PROC":  # "ERR": documented, never seen in 1.5.1
            raise self._fail(handle, None, f"nixl reported state {state!r}")

    def _fail(self, handle: ReadHandle, cause: BaseException | None, what: str, count: bool = True) -> TransferFailed:
        handle.state = TransferState.FAILED
        op = "notification to" if handle.control else f"READ of {len(handle.local_block_ids)} blocks from"
        handle.error = TransferFailed(
            f"engine {self.engine_id}: {op} peer {handle.peer_engine_id} (notif {handle.notif_msg[:64]!r}): {what}"
            + (f": {type(cause).__name__}: {cause}" if cause else ""),
            peer_engine_id=handle.peer_engine_id, local_block_ids=handle.local_block_ids,
            remote_block_ids=handle.remote_block_ids, notif_msg=handle.notif_msg, cause=cause,
        )
        self._release_handles(handle)
        if count:
            self._stats.record_failed()
            peer = self._peers.get(handle.peer_engine_id)
            if peer is not None:
                peer.stale = True
            logger.warning("%s", handle.error)
        return handle.error

    def _retry_unreleased(self, final: bool = False) -> None:
        handles, self._unreleased = self._unreleased, []
        for nixl_handle in handles:
            self._release_one(nixl_handle, retry=not final)

    def _release_handles(self, handle: ReadHandle) -> None:
        self._inflight.discard(handle)
        for nixl_handle in handle._nixl:
            self._release_one(nixl_handle, retry=True)
        handle._nixl.clear()

    def _release_one(self, nixl_handle: Any, retry: bool) -> None:
        try:
            nixl_handle.release()
        except Exception:  # e.g. an xfer that could not be cancelled; keep it and try again at close()
            logger.warning("engine %s: releasing %r failed", self.engine_id, nixl_handle, exc_info=True)
            if retry:
                self._unreleased.append(nixl_handle)


def _check_kv_tensor(spec: KVCacheSpec, kv_cache: Any) -> None:
    expected = (spec.num_blocks, spec.num_layers, 2, spec.block_size, spec.num_kv_heads, spec.head_dim)
    if tuple(kv_cache.shape) != expected:
        raise ValueError(f"KV tensor shape {tuple(kv_cache.shape)}, expected {expected} ({KV_LAYOUT})")
    if str(kv_cache.dtype).removeprefix("torch.") != spec.dtype:
        raise ValueError(f"KV tensor dtype {kv_cache.dtype}, expected {spec.dtype}")
    if not kv_cache.is_contiguous():
        raise ValueError("KV tensor must be contiguous: blocks are addressed as base + id * bytes_per_block")
