"""The NIXL connector's worker side: registers the KV tensor, serves the side channel, posts the READs
the scheduler side planned, and reports finished sends/receives and failed blocks each step.

Two threads: the engine (model runner) thread calls the connector API - start_load_kv() queues the step's
loads and sends, get_finished() / get_block_ids_with_load_errors() / get_kv_connector_stats() take what is
done - and never waits on nixl; a ProgressThread (nixl_progress.py) owns the NixlTransport (not
thread-safe) and does every nixl call: posts, polls, timeouts, notifications, leases. They share only
`_inbox` (a queue) and the result sets under `_lock`; a request's finished id and its failed blocks are
published together, so a step that sees one sees the other. See nixl.py for the flow.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from typing import TYPE_CHECKING, Any

from disagg.worker.kv_transfer.base import KVCacheSpec
from disagg.worker.kv_transfer.nixl_metadata import (
    LoadSpec,
    NixlConnectorMetadata,
    NixlSettings,
    lease_over,
    read_expired,
)
from disagg.worker.kv_transfer.nixl_metrics import merge_stats
from disagg.worker.kv_transfer.nixl_progress import ProgressThread
from disagg.worker.kv_transfer.nixl_transport import NixlTransport, ReadHandle, TransferFailed, TransferState
from disagg.worker.kv_transfer.side_channel import SideChannelServer

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

POLL_BUSY_S = 0.0005  # progress interval while reads are in flight or KV waits here to be pulled
POLL_IDLE_S = 0.02  # otherwise (late notifications still get picked up)


class NixlConnectorWorker:
    def __init__(self, settings: NixlSettings, kv_cache_spec: KVCacheSpec):
        self.settings = settings
        self.kv_cache_spec = kv_cache_spec
        self.transport: NixlTransport | None = None  # after register_kv_caches
        self.side_channel: SideChannelServer | None = None
        self._reads: dict[str, tuple[ReadHandle, LoadSpec]] = {}  # req_id -> in-flight read
        self._sends: dict[str, float] = {}  # req_id -> lease deadline (monotonic s)
        self._early_notifs: dict[str, float] = {}  # req_id -> when its notification beat its send record
        self._done_sending: set[str] = set()  # reported by the next get_finished()
        self._done_recving: set[str] = set()
        self._load_errors: set[int] = set()  # local block ids, reported by get_block_ids_with_load_errors()
        self._new_recving: set[str] = set()  # progress thread's results of this round, published under _lock
        self._new_errors: set[int] = set()
        self._new_sending: set[str] = set()
        self._num_expired = 0  # leases that ran out since the last stats
        self._num_released = 0  # sends released unread (release()) since the last stats
        self._num_rejected_notifs = 0  # notifications ignored since the last stats (not from the KV's reader)
        self._inbox: queue.SimpleQueue[NixlConnectorMetadata] = queue.SimpleQueue()  # engine -> progress thread
        self._lock = threading.Lock()  # guards the four results below (progress thread -> engine)
        self._landed = threading.Event()  # set when a read's result (done or failed) was published
        self._stats: dict[str, Any] | None = None
        self._progress_thread: ProgressThread | None = None

    def register_kv_caches(self, kv_caches: dict[str, "torch.Tensor"]) -> None:
        s = self.settings
        self.transport = NixlTransport(s.engine_id, self.kv_cache_spec, kv_caches["kv_cache"])
        self.transport.register()
        self.side_channel = SideChannelServer(self.transport.local_metadata(), s.bind_host, s.port, s.auth)
        logger.info("NIXL connector: engine %s, %s KV registered, side channel %s:%d (advertised %s)",
                    s.engine_id, self.transport.device_kind, s.bind_host, s.port, s.advertise_host)
        self._progress_thread = ProgressThread(self._progress, name=f"nixl-progress-{s.engine_id[:8]}")
        self._progress_thread.start()

    # -------- engine thread
    def start_load_kv(self, meta: NixlConnectorMetadata) -> None:
        if meta.loads or meta.sends or meta.releases:
            self._inbox.put(meta)
            self._progress_thread.wake()

    def get_finished(self) -> tuple[set[str] | None, set[str] | None]:
        if self.transport is None:
            return None, None
        self._check_progress_thread()
        with self._lock:
            sending, recving = self._done_sending, self._done_recving
            self._done_sending, self._done_recving = set(), set()
        return sending or None, recving or None

    def wait_for_landed(self, timeout: float) -> None:
        """Sleep up to `timeout`, waking as soon as the progress thread publishes a finished or failed
        read: a fixed sleep there (1 ms asked, several on a busy machine) went into that request's TTFT."""
        if self._landed.wait(timeout):
            self._landed.clear()  # the engine's next step collects what was published

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._lock:
            errors, self._load_errors = self._load_errors, set()
        return errors

    def get_kv_connector_stats(self) -> dict[str, Any] | None:
        with self._lock:
            stats, self._stats = self._stats, None
        return stats

    def _check_progress_thread(self) -> None:
        thread = self._progress_thread
        if thread is not None and thread.error is not None:
            raise RuntimeError(f"the NIXL progress thread died: {thread.error}") from thread.error

    # -------- progress thread (owns self.transport, the in-flight state and the _new_* results)
    def _progress(self) -> float:
        """One round: new work, reads, notifications, leases, then publish; returns seconds until the next."""
        while True:
            try:
                meta = self._inbox.get_nowait()
            except queue.Empty:
                break
            self._apply(meta)
        self._poll_reads()
        now = time.monotonic()
        self._take_notifs(now)
        self._expire_leases(now)
        stats = self._drain_stats()
        with self._lock:  # a request's finished id and its failed blocks become visible together
            self._done_recving |= self._new_recving
            self._load_errors |= self._new_errors
            self._done_sending |= self._new_sending
            self._stats = merge_stats(self._stats, stats)
        if self._new_recving or self._new_errors:
            self._landed.set()
        self._new_recving, self._new_errors, self._new_sending = set(), set(), set()
        return POLL_BUSY_S if self._reads or self._sends else POLL_IDLE_S

    def _apply(self, meta: NixlConnectorMetadata) -> None:
        for req_id, deadline in meta.sends.items():
            if self._early_notifs.pop(req_id, None) is not None:
                self._new_sending.add(req_id)
            else:
                self._sends[req_id] = deadline
        for req_id in meta.releases:  # nobody will pull these (their decode hop was refused): freed now
            if self._sends.pop(req_id, None) is not None:
                self._new_sending.add(req_id)
                self._num_released += 1
        for load in meta.loads:
            self._start_read(load)

    def _start_read(self, load: LoadSpec) -> None:
        try:
            if lease_over(load.lease_expires_at, self.settings.lease_margin):
                raise TimeoutError("the prefill engine's lease on this KV ran out before the read")
            self.transport.add_peer(load.peer)
            auth = self.settings.auth  # with a key: only this agent's notification releases the prefill's blocks
            msg = auth.notification(load.remote_request_id, self.transport.agent_name) if auth is not None \
                else load.remote_request_id.encode()
            if load.local_block_ids:
                handle = self.transport.start_read(load.peer.engine_id, load.local_block_ids,
                                                   load.remote_block_ids, msg)
            else:  # every needed block was cached here: only release the sender, tracked like a read so
                handle = self.transport.notify(load.peer.engine_id, msg)  # the engine steps until it is out
            self._reads[load.req_id] = (handle, load)
        except Exception as e:  # noqa: BLE001 - any failure (nixl's errors share no base) invalidates these blocks
            logger.warning("request %s: reading KV from %s failed: %s", load.req_id, load.peer.engine_id, e)
            self._new_errors.update(load.local_block_ids)
            self._new_recving.add(load.req_id)

    def _poll_reads(self) -> None:
        """Finished, failed and abandoned reads end (a failed or abandoned one's blocks are invalid)."""
        for req_id, (handle, load) in list(self._reads.items()):
            try:
                state = self.transport.poll(handle)
                if state is TransferState.DONE and lease_over(load.lease_expires_at, 0.0):
                    self.transport.count_failed()
                    raise TransferFailed("the READ finished after the prefill engine's lease ran out: the "
                                         "blocks may hold another request's KV", peer_engine_id=load.peer.engine_id,
                                         local_block_ids=load.local_block_ids,
                                         remote_block_ids=load.remote_block_ids, notif_msg=b"", cause=None)
                why = None if state is not TransferState.PROC else read_expired(
                    handle.posted_at, time.monotonic(), self.settings.read_timeout, load.lease_expires_at,
                    time.time())
                if why is not None:
                    raise self.transport.abandon(handle, why)
            except TransferFailed as e:
                logger.warning("request %s: %s", req_id, e)
                self._new_errors.update(load.local_block_ids)
                state = TransferState.FAILED
            if state is not TransferState.PROC:
                del self._reads[req_id]
                self._new_recving.add(req_id)

    def _take_notifs(self, now: float) -> None:
        """A reader's notification ends a send; one that arrives before its send record waits for it. With a
        hand-off key only a notification signed for the very agent NIXL says sent it counts: any other is
        ignored (the blocks stay for their reader, or until the lease ends) and counted."""
        auth = self.settings.auth
        for agent, msg in self.transport.get_new_notifs():
            req_id = msg.decode(errors="replace") if auth is None else auth.check_notification(msg, agent)
            if req_id is None:
                self._num_rejected_notifs += 1
                logger.warning("ignored a KV notification from agent %r: not signed for that agent (%r)",
                               agent[:80], msg[:80])
                continue
            if self._sends.pop(req_id, None) is not None:
                self._new_sending.add(req_id)
            else:
                self._early_notifs[req_id] = now

    def _expire_leases(self, now: float) -> None:
        lease = self.settings.lease_seconds
        for req_id, deadline in list(self._sends.items()):
            if now >= deadline:
                del self._sends[req_id]
                self._new_sending.add(req_id)
                self._num_expired += 1
                logger.warning("request %s: KV not pulled within the %.0fs lease; blocks freed", req_id, lease)
        for req_id, t in list(self._early_notifs.items()):
            if now - t > lease:
                del self._early_notifs[req_id]

    def _drain_stats(self) -> dict[str, Any] | None:
        stats = self.transport.drain_stats()
        stats["num_kv_expired_reqs"], self._num_expired = self._num_expired, 0
        stats["num_kv_released_reqs"], self._num_released = self._num_released, 0
        stats["num_notifications_rejected"], self._num_rejected_notifs = self._num_rejected_notifs, 0
        if not stats["bytes"] and not any(stats[k] for k in ("num_failed_transfers", "num_kv_expired_reqs",
                                                              "num_kv_released_reqs", "num_notifications_rejected")):
            return None
        return stats

    def shutdown(self) -> None:
        if self._progress_thread is not None:
            self._progress_thread.stop()  # joined: the transport is ours again
            self._progress_thread = None
        if self.side_channel is not None:
            self.side_channel.close()
            self.side_channel = None
        if self.transport is not None:
            self.transport.close()
            self.transport = None
