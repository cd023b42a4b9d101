"""The NIXL connector's scheduler side: which blocks a request reads or keeps for a reader, and when.

Pure bookkeeping plus the side-channel handshake, which runs in a background thread (the scheduler
asks again next step until it is done); never touches KV memory or nixl. See nixl.py for the flow.
"""
from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from disagg.worker.kv_transfer.base import KVCacheSpec, KVTransferParamsError
from disagg.worker.kv_transfer.nixl_metadata import LoadSpec, NixlConnectorMetadata, NixlSettings, lease_over
from disagg.worker.kv_transfer.handoff import Handoff, RemoteKV
from disagg.worker.kv_transfer.side_channel import (
    EngineMetadata,
    SideChannelError,
    fetch_engine_metadata,
    spec_compat_fields,
)

if TYPE_CHECKING:
    from disagg.worker.outputs import ConnectorRequest

logger = logging.getLogger(__name__)

SideChannel = tuple[str, int]  # (host, port) of a prefill engine's side channel
HANDSHAKE_DEADLINE_FACTOR = 2  # a whole metadata fetch gets this many handshake_timeout_seconds


class NixlConnectorScheduler:
    def __init__(self, settings: NixlSettings, kv_cache_spec: KVCacheSpec, kv_load_failure_policy: str):
        self.settings = settings
        self.block_size = kv_cache_spec.block_size
        self.failure_policy = kv_load_failure_policy
        self._local_compat = spec_compat_fields(kv_cache_spec)
        self._peers: dict[SideChannel, EngineMetadata] = {}
        self._handshakes: dict[SideChannel, tuple[Future, float]] = {}  # -> (fetch, monotonic deadline)
        self._executor: ThreadPoolExecutor | None = None
        self._pending_loads: list[LoadSpec] = []  # for the next step's metadata
        self._new_sends: dict[str, float] = {}  # req_id -> lease deadline, for the next step's metadata
        self._releases: list[str] = []  # sends nobody will pull, freed by the worker side at the next step
        self._loading: dict[str, SideChannel] = {}  # req_id -> side channel of its prefill engine
        self._sending: set[str] = set()  # finished here, blocks held for a remote reader
        self._consumed: set[str] = set()  # requests whose remote prefill was handled (or given up)

    # -------- decode side: reading a prompt's KV
    def validate_kv_transfer_params(self, prompt_token_ids: list[int], params: Handoff) -> None:
        if params.remote is None:
            return
        ids = params.remote.block_ids
        if ids and isinstance(ids[0], tuple):
            raise KVTransferParamsError(
                "kv_transfer_params.remote_block_ids: one list per KV-cache group (vLLM's layout) does not fit "
                "this engine, which has one group: expected a flat list of block ids")
        needed = -(-len(prompt_token_ids) // self.block_size)
        if len(ids) != needed:
            raise KVTransferParamsError(
                f"kv_transfer_params.remote_block_ids has {len(ids)} ids but the prompt's "
                f"{len(prompt_token_ids)} tokens fill {needed} blocks of {self.block_size}"
            )

    def get_num_new_matched_tokens(self, request: "ConnectorRequest",
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        p = _remote(request)
        if p is None or request.request_id in self._consumed or request.num_output_tokens:
            return 0, False
        if lease_over(p.lease_expires_at, self.settings.lease_margin):
            self._remote_unusable(request, "the prefill engine's lease on this request's KV has run out")
            return 0, False
        peer = self._peer_for(request, p)
        if peer is None:
            return (0, False) if request.request_id in self._consumed else (None, False)
        if peer.compat != self._local_compat:
            differing = sorted(k for k in set(peer.compat) | set(self._local_compat)
                               if peer.compat.get(k) != self._local_compat.get(k))
            raise KVTransferParamsError(
                f"prefill engine {peer.engine_id} is incompatible with this engine: "
                + ", ".join(f"{k} {peer.compat.get(k)!r} != {self._local_compat.get(k)!r}" for k in differing)
            )
        out_of_range = [b for b in p.block_ids if b >= peer.num_blocks]
        if out_of_range:
            raise KVTransferParamsError(
                f"kv_transfer_params.remote_block_ids {out_of_range[:8]} are outside prefill engine "
                f"{peer.engine_id}'s {peer.num_blocks} blocks"
            )
        return request.num_prompt_tokens - num_computed_tokens, True

    def _peer_for(self, request: "ConnectorRequest", p: RemoteKV) -> EngineMetadata | None:
        """Cached or freshly fetched metadata of the request's prefill engine; None while the
        handshake runs, or when it failed under policy recompute (the request is then consumed)."""
        key = (p.host, p.port)
        peer = self._peers.get(key)
        if peer is not None and peer.engine_id == p.engine_id:
            return peer
        future, deadline = self._handshakes.get(key, (None, 0.0))
        if future is None:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="nixl-handshake")
            timeout = self.settings.handshake_timeout
            # the socket timeout bounds each operation (connect, send, read); the deadline bounds them together
            fetch = self._executor.submit(fetch_engine_metadata, *key, timeout, self.settings.auth,
                                          self.settings.engine_id)  # our NIXL agent's name is the engine id
            self._handshakes[key] = (fetch, time.monotonic() + HANDSHAKE_DEADLINE_FACTOR * timeout)
            return None
        if not future.done():
            if time.monotonic() < deadline:
                return None
            del self._handshakes[key]  # the fetch thread ends at its next socket timeout
            return self._remote_unusable(request, f"handshake with the prefill engine at {key[0]}:{key[1]} took "
                                         f"over {HANDSHAKE_DEADLINE_FACTOR} x handshake_timeout_seconds")
        del self._handshakes[key]
        try:
            peer = future.result()
        except SideChannelError as e:
            return self._remote_unusable(request, f"handshake with the prefill engine failed: {e}")
        self._peers[key] = peer
        if peer.engine_id != p.engine_id:
            return self._remote_unusable(
                request, f"the engine at {key[0]}:{key[1]} is {peer.engine_id}, not {p.engine_id} "
                "(the prefill engine restarted; its blocks are gone)")
        return peer

    def _remote_unusable(self, request: "ConnectorRequest", message: str) -> None:
        if self.failure_policy == "fail":
            raise KVTransferParamsError(f"request {request.request_id}: {message}")
        logger.warning("request %s: %s; computing the prompt locally", request.request_id, message)
        self._consumed.add(request.request_id)
        return None

    def update_state_after_alloc(self, request: "ConnectorRequest",
                                 block_ids: list[int], num_external_tokens: int) -> None:
        p = _remote(request)
        if not num_external_tokens or p is None or request.request_id in self._consumed:
            return
        self._consumed.add(request.request_id)
        key = (p.host, p.port)
        start = request.num_prompt_tokens - num_external_tokens  # block-aligned (local prefix hit)
        first = start // self.block_size
        # the last prompt token is recomputed for its logits: read the blocks up to the one before it
        last = (request.num_prompt_tokens - 2) // self.block_size
        n = max(0, last - first + 1) if request.num_prompt_tokens >= 2 else 0
        self._pending_loads.append(LoadSpec(
            request.request_id, p.request_id, self._peers[key],
            list(block_ids[first : first + n]), list(p.block_ids[first : first + n]),
            p.lease_expires_at,
        ))
        self._loading[request.request_id] = key

    # -------- every step
    def build_connector_meta(self) -> NixlConnectorMetadata:
        meta = NixlConnectorMetadata(self._pending_loads, self._new_sends, self._releases)
        self._pending_loads, self._new_sends, self._releases = [], {}, []
        return meta

    def update_connector_output(self, connector_output: Any) -> None:
        for req_id in connector_output.finished_sending or ():
            self._sending.discard(req_id)
        for req_id in connector_output.finished_recving or ():
            key = self._loading.pop(req_id, None)
            if connector_output.invalid_block_ids and key is not None:
                self._peers.pop(key, None)  # maybe restarted: handshake again next time

    # -------- prefill side: keeping a prompt's KV for a reader
    def request_finished(self, request: "ConnectorRequest", block_ids: list[int]) -> tuple[bool, Handoff | None]:
        self._consumed.discard(request.request_id)
        handoff = request.kv_transfer_params
        if handoff is None or not handoff.is_prefill_hop or request.status.finish_reason in ("abort", "error"):
            return False, None
        n = -(-request.num_prompt_tokens // self.block_size)
        if len(block_ids) < n:
            return False, None
        s = self.settings
        self._new_sends[request.request_id] = time.monotonic() + s.lease_seconds
        self._sending.add(request.request_id)
        remote = RemoteKV(s.engine_id, tuple(block_ids[:n]), s.advertise_host, s.port, request.request_id,
                          time.time() + s.lease_seconds)
        return True, Handoff(do_remote_decode=False, do_remote_prefill=True, remote=remote, extra={"tp_size": 1})

    def release(self, request_id: str) -> bool:
        """A send nobody will pull: the worker side ends it as a reader's notification would (the scheduler
        then frees its blocks). Only while it is pending: one pulled or expired already is left alone."""
        if request_id not in self._sending:
            return False
        self._sending.discard(request_id)
        self._releases.append(request_id)
        return True

    def get_pending_counts(self) -> dict[str, int]:
        return {"pending_sends": len(self._sending), "pending_loads": len(self._loading)}

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)


def _remote(request: "ConnectorRequest") -> RemoteKV | None:
    """Where the request's prompt KV is, when it reads remote KV (checked when it arrived)."""
    return request.kv_transfer_params.remote if request.kv_transfer_params is not None else None
