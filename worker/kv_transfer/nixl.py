"""NIXL KV connector: the decode engine READs each prompt's KV blocks from the prefill engine.

Flow (vLLM's NIXL protocol, one prefill and one decode hop per request):
  prefill: request with kv_transfer_params {"do_remote_decode": true} runs its prompt, finishes;
           request_finished() keeps its blocks (delay_free) and returns kv_transfer_params naming
           this engine, its side channel and the prompt's block ids; the blocks stay until the
           decode side's notification arrives or the lease expires.
  decode:  request with those params -> get_num_new_matched_tokens() asks for the prompt's tokens
           asynchronously (after a side-channel handshake, validated before any allocation);
           the worker side READs the remote blocks into the freshly allocated local ones
           (contiguous runs coalesced), completion surfaces as finished_recving, and the READ's
           notification tells prefill to free (on a full local prefix hit the notification
           alone, sent and tracked the same way). Failures surface as invalid_block_ids.

Scheduler-side network I/O (the handshake) runs in a background thread; the scheduler is asked
again next step until it is done. NIXL's progress thread is off: progress happens when the engine
loop calls get_finished() each step (see nixl_transport.py).

extra config: side_channel_host (bind; default 127.0.0.1), side_channel_advertise_host (what
peers dial; default the bind host), side_channel_port (0 = pick a free port), lease_seconds
(default 30), handshake_timeout_seconds (default 5), lease_margin_seconds (default 1).

Leases: prefill frees unread blocks when the lease runs out and may reuse them at once, so a late
READ would copy another request's KV without any error. kv_transfer_params therefore carry the
lease's wall-clock end (remote_lease_expires_at); the decode side does not start a READ within
lease_margin_seconds of it and treats the KV as lost (recompute or fail). Node clocks must agree
to within that margin (NTP).
"""
from __future__ import annotations

import logging
import socket
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from disagg.worker.kv_transfer.base import (
    KVCacheSpec,
    KVConnectorBase,
    KVConnectorRole,
    KVTransferConfig,
    KVTransferParamsError,
)
from disagg.worker.kv_transfer.side_channel import (
    EngineMetadata,
    SideChannelError,
    fetch_engine_metadata,
    spec_compat_fields,
)

if TYPE_CHECKING:
    import torch

    from disagg.worker.engine.request import Request
    from disagg.worker.engine.outputs import SchedulerOutput

logger = logging.getLogger(__name__)

REQUIRED_PARAMS = {
    "remote_engine_id": str,
    "remote_block_ids": list,
    "remote_host": str,
    "remote_port": int,
    "remote_request_id": str,
}


def _require_nixl() -> None:
    try:
        import nixl._api  # noqa: F401
    except ImportError as e:
        raise ImportError(
            "NixlConnector needs the 'nixl' package: pip install nixl==1.5.1 (install torch first, "
            f"since nixl declares it) ({e})"
        ) from e


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host if host not in ("", "0.0.0.0") else "127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class LoadSpec:
    """Decode side: one request's pull of remote blocks."""

    req_id: str
    remote_request_id: str  # the prefill engine's id for it; sent back as the READ's notification
    peer: EngineMetadata
    local_block_ids: list[int]  # same length as remote_block_ids; empty -> notify only
    remote_block_ids: list[int]
    lease_expires_at: float | None = None  # wall clock (time.time()) when prefill may reuse the blocks


@dataclass
class NixlConnectorMetadata:
    loads: list[LoadSpec] = field(default_factory=list)  # reads to start this step
    sends: dict[str, float] = field(default_factory=dict)  # req_id -> lease deadline (monotonic s)


DEFAULT_LEASE_SECONDS = 30.0  # extra config lease_seconds: how long prefill keeps unread KV


class NixlConnector(KVConnectorBase):
    def __init__(self, config: KVTransferConfig, role: KVConnectorRole, kv_cache_spec: KVCacheSpec):
        _require_nixl()
        super().__init__(config, role, kv_cache_spec)
        extra = config.kv_connector_extra_config
        self.engine_id = config.engine_id
        self.block_size = kv_cache_spec.block_size
        self.lease_seconds = float(extra.get("lease_seconds", DEFAULT_LEASE_SECONDS))
        self.handshake_timeout = float(extra.get("handshake_timeout_seconds", 5))
        self.lease_margin = float(extra.get("lease_margin_seconds", 1))
        self.bind_host = extra.get("side_channel_host", "127.0.0.1")
        if not extra.get("side_channel_port"):
            # both roles read this dict: the first one picks the port, the worker side binds it
            extra["side_channel_port"] = _free_port(self.bind_host)
        self.port = int(extra["side_channel_port"])
        advertise = extra.get("side_channel_advertise_host") or self.bind_host
        self.advertise_host = socket.gethostbyname(socket.gethostname()) if advertise == "0.0.0.0" else advertise
        if role == KVConnectorRole.SCHEDULER:
            self._init_scheduler()
        else:
            self._init_worker()

    # ================================================================ scheduler role
    def _init_scheduler(self) -> None:
        self._peers: dict[tuple[str, int], EngineMetadata] = {}  # side channel -> metadata
        self._handshakes: dict[tuple[str, int], Future] = {}
        self._executor: ThreadPoolExecutor | None = None
        self._pending_loads: list[LoadSpec] = []
        self._new_sends: dict[str, float] = {}
        self._loading: dict[str, tuple[str, int]] = {}  # req_id -> side channel of its prefill engine
        self._sending: set[str] = set()
        self._consumed: set[str] = set()  # requests whose remote prefill was handled (or given up)
        s = self.kv_cache_spec
        self._local_compat = spec_compat_fields(s)

    def validate_kv_transfer_params(self, prompt_token_ids: list[int], params: dict[str, Any]) -> None:
        for flag in ("do_remote_prefill", "do_remote_decode"):
            if flag in params and not isinstance(params[flag], bool):
                raise KVTransferParamsError(f"kv_transfer_params.{flag} must be a boolean, got {params[flag]!r}")
        if not params.get("do_remote_prefill"):
            return
        for key, typ in REQUIRED_PARAMS.items():
            value = params.get(key)
            if not isinstance(value, typ) or isinstance(value, bool) or (typ is str and not value):
                raise KVTransferParamsError(
                    f"kv_transfer_params.{key} must be a non-empty {typ.__name__}, got {value!r}"
                )
        if not 0 < params["remote_port"] < 65536:
            raise KVTransferParamsError(f"kv_transfer_params.remote_port {params['remote_port']} is not a TCP port")
        expires = params.get("remote_lease_expires_at")
        if expires is not None and (not isinstance(expires, (int, float)) or isinstance(expires, bool)):
            raise KVTransferParamsError(f"kv_transfer_params.remote_lease_expires_at must be a number, got {expires!r}")
        ids = params["remote_block_ids"]
        bad = [b for b in ids if not isinstance(b, int) or isinstance(b, bool) or b < 0]
        if bad or len(set(ids)) != len(ids):
            raise KVTransferParamsError(
                f"kv_transfer_params.remote_block_ids must be distinct non-negative integers, got {ids[:16]!r}"
            )
        needed = -(-len(prompt_token_ids) // self.block_size)
        if len(ids) != needed:
            raise KVTransferParamsError(
                f"kv_transfer_params.remote_block_ids has {len(ids)} ids but the prompt's {len(prompt_token_ids)} "
                f"tokens fill {needed} blocks of {self.block_size}"
            )

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        params = request.kv_transfer_params or {}
        if not params.get("do_remote_prefill") or request.request_id in self._consumed or request.num_output_tokens:
            return 0, False
        if _lease_over(params.get("remote_lease_expires_at"), self.lease_margin):
            self._remote_unusable(request, "the prefill engine's lease on this request's KV has run out")
            return 0, False
        peer = self._peer_for(request, params)
        if peer is None:
            return (0, False) if request.request_id in self._consumed else (None, False)
        if peer.compat != self._local_compat:
            differing = sorted(k for k in set(peer.compat) | set(self._local_compat)
                               if peer.compat.get(k) != self._local_compat.get(k))
            raise KVTransferParamsError(
                f"prefill engine {peer.engine_id} is incompatible with this engine: "
                + ", ".join(f"{k} {peer.compat.get(k)!r} != {self._local_compat.get(k)!r}" for k in differing)
            )
        out_of_range = [b for b in params["remote_block_ids"] if b >= peer.num_blocks]
        if out_of_range:
            raise KVTransferParamsError(
                f"kv_transfer_params.remote_block_ids {out_of_range[:8]} are outside prefill engine "
                f"{peer.engine_id}'s {peer.num_blocks} blocks"
            )
        return request.num_prompt_tokens - num_computed_tokens, True

    def _peer_for(self, request: "Request", params: dict[str, Any]) -> EngineMetadata | None:
        """Cached or freshly fetched metadata of the request's prefill engine; None while the
        handshake runs, or when it failed under policy recompute (the request is then consumed)."""
        key = (params["remote_host"], params["remote_port"])
        peer = self._peers.get(key)
        if peer is not None and peer.engine_id == params["remote_engine_id"]:
            return peer
        future = self._handshakes.get(key)
        if future is None:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="nixl-handshake")
            self._handshakes[key] = self._executor.submit(fetch_engine_metadata, *key, self.handshake_timeout)
            return None
        if not future.done():
            return None
        del self._handshakes[key]
        try:
            peer = future.result()
        except SideChannelError as e:
            return self._remote_unusable(request, f"handshake with the prefill engine failed: {e}")
        self._peers[key] = peer
        if peer.engine_id != params["remote_engine_id"]:
            return self._remote_unusable(
                request, f"the engine at {key[0]}:{key[1]} is {peer.engine_id}, not {params['remote_engine_id']} "
                "(the prefill engine restarted; its blocks are gone)")
        return peer

    def _remote_unusable(self, request: "Request", message: str) -> None:
        if self.config.kv_load_failure_policy == "fail":
            raise KVTransferParamsError(f"request {request.request_id}: {message}")
        logger.warning("request %s: %s; computing the prompt locally", request.request_id, message)
        self._consumed.add(request.request_id)
        return None

    def update_state_after_alloc(self, request: "Request", block_ids: list[int], num_external_tokens: int) -> None:
        params = request.kv_transfer_params or {}
        if not num_external_tokens or not params.get("do_remote_prefill") or request.request_id in self._consumed:
            return
        self._consumed.add(request.request_id)
        key = (params["remote_host"], params["remote_port"])
        start = request.num_prompt_tokens - num_external_tokens  # block-aligned (local prefix hit)
        first = start // self.block_size
        # the last prompt token is recomputed for its logits: read the blocks up to the one before it
        last = (request.num_prompt_tokens - 2) // self.block_size
        n = max(0, last - first + 1) if request.num_prompt_tokens >= 2 else 0
        self._pending_loads.append(LoadSpec(
            request.request_id, params["remote_request_id"], self._peers[key],
            list(block_ids[first : first + n]), list(params["remote_block_ids"][first : first + n]),
            params.get("remote_lease_expires_at"),
        ))
        self._loading[request.request_id] = key

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> NixlConnectorMetadata:
        meta = NixlConnectorMetadata(self._pending_loads, self._new_sends)
        self._pending_loads, self._new_sends = [], {}
        return meta

    def update_connector_output(self, connector_output: Any) -> None:
        for req_id in connector_output.finished_sending or ():
            self._sending.discard(req_id)
        for req_id in connector_output.finished_recving or ():
            key = self._loading.pop(req_id, None)
            if connector_output.invalid_block_ids and key is not None:
                self._peers.pop(key, None)  # maybe restarted: handshake again next time

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._consumed.discard(request.request_id)
        params = request.kv_transfer_params or {}
        if not params.get("do_remote_decode") or request.status.finish_reason in ("abort", "error"):
            return False, None
        n = -(-request.num_prompt_tokens // self.block_size)
        if len(block_ids) < n:
            return False, None
        self._new_sends[request.request_id] = time.monotonic() + self.lease_seconds
        self._sending.add(request.request_id)
        return True, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.engine_id,
            "remote_block_ids": list(block_ids[:n]),
            "remote_host": self.advertise_host,
            "remote_port": self.port,
            "remote_request_id": request.request_id,
            "remote_lease_expires_at": time.time() + self.lease_seconds,
            "tp_size": 1,
        }

    def get_pending_counts(self) -> dict[str, int]:
        return {"pending_sends": len(self._sending), "pending_loads": len(self._loading)}

    # ================================================================ worker role
    def _init_worker(self) -> None:
        self.transport: Any = None
        self.side_channel: Any = None
        self._reads: dict[str, tuple[Any, LoadSpec]] = {}  # req_id -> (ReadHandle, spec)
        self._sends: dict[str, float] = {}  # req_id -> lease deadline
        self._early_notifs: dict[str, float] = {}  # notifications that beat their send record
        self._done_sending: set[str] = set()
        self._done_recving: set[str] = set()
        self._load_errors: set[int] = set()
        self._num_expired = 0

    def register_kv_caches(self, kv_caches: dict[str, "torch.Tensor"]) -> None:
        from disagg.worker.kv_transfer.nixl_transport import NixlTransport
        from disagg.worker.kv_transfer.side_channel import SideChannelServer

        self.transport = NixlTransport(self.engine_id, self.kv_cache_spec, kv_caches["kv_cache"])
        self.transport.register()
        self.side_channel = SideChannelServer(self.transport.local_metadata(), self.bind_host, self.port)
        logger.info("NIXL connector: engine %s, %s KV registered, side channel %s:%d (advertised %s)",
                    self.engine_id, self.transport.device_kind, self.bind_host, self.port, self.advertise_host)

    def start_load_kv(self, **kwargs: Any) -> None:
        meta: NixlConnectorMetadata = self._get_connector_metadata()
        for req_id, deadline in meta.sends.items():
            if self._early_notifs.pop(req_id, None) is not None:
                self._done_sending.add(req_id)
            else:
                self._sends[req_id] = deadline
        for load in meta.loads:
            self._start_read(load)

    def _start_read(self, load: LoadSpec) -> None:
        try:
            if _lease_over(load.lease_expires_at, self.lease_margin):
                raise TimeoutError("the prefill engine's lease on this KV ran out before the read")
            self.transport.add_peer(load.peer)
            msg = load.remote_request_id.encode()
            if load.local_block_ids:
                handle = self.transport.start_read(load.peer.engine_id, load.local_block_ids,
                                                   load.remote_block_ids, msg)
            else:  # every needed block was cached here: only release the sender, tracked like a read so
                handle = self.transport.notify(load.peer.engine_id, msg)  # the engine steps until it is out
            self._reads[load.req_id] = (handle, load)
        except Exception as e:  # noqa: BLE001 - any failure (nixl's errors share no base) invalidates these blocks
            logger.warning("request %s: reading KV from %s failed: %s", load.req_id, load.peer.engine_id, e)
            self._load_errors.update(load.local_block_ids)
            self._done_recving.add(load.req_id)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        from disagg.worker.kv_transfer.nixl_transport import TransferFailed

        if self.transport is None:
            return None, None
        for req_id, (handle, load) in list(self._reads.items()):
            try:
                state = self.transport.poll(handle)
            except TransferFailed as e:
                logger.warning("request %s: %s", req_id, e)
                self._load_errors.update(load.local_block_ids)
                state = "FAILED"
            if state != "PROC":
                del self._reads[req_id]
                self._done_recving.add(req_id)
        now = time.monotonic()
        for _agent, msg in self.transport.get_new_notifs():
            req_id = msg.decode(errors="replace")
            if self._sends.pop(req_id, None) is not None:
                self._done_sending.add(req_id)
            else:
                self._early_notifs[req_id] = now
        for req_id, deadline in list(self._sends.items()):
            if now >= deadline:
                del self._sends[req_id]
                self._done_sending.add(req_id)
                self._num_expired += 1
                logger.warning("request %s: KV not pulled within the %.0fs lease; blocks freed", req_id,
                               self.lease_seconds)
        for req_id, t in list(self._early_notifs.items()):
            if now - t > self.lease_seconds:
                del self._early_notifs[req_id]
        sending, recving = self._done_sending, self._done_recving
        self._done_sending, self._done_recving = set(), set()
        return sending or None, recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def get_kv_connector_stats(self) -> dict[str, Any] | None:
        if self.transport is None:
            return None
        stats = self.transport.drain_stats()
        stats["num_kv_expired_reqs"], self._num_expired = self._num_expired, 0
        if not stats["bytes"] and not stats["num_failed_transfers"] and not stats["num_kv_expired_reqs"]:
            return None
        return stats

    def shutdown(self) -> None:
        if self.role == KVConnectorRole.SCHEDULER:
            if self._executor is not None:
                self._executor.shutdown(wait=False, cancel_futures=True)
            return
        if self.side_channel is not None:
            self.side_channel.close()
            self.side_channel = None
        if self.transport is not None:
            self.transport.close()
            self.transport = None


def _lease_over(expires: Any, margin: float) -> bool:
    """True when the sender may already have reused the blocks (`expires`: remote_lease_expires_at, wall clock;
    missing: trust the sender)."""
    return isinstance(expires, (int, float)) and not isinstance(expires, bool) and time.time() > expires - margin
