"""What the NIXL connector's two sides share: its settings and the step metadata the scheduler side
hands the worker side (plain dataclasses, no torch, no nixl)."""
from __future__ import annotations

import socket
import time
from dataclasses import dataclass, field
from typing import Any

from disagg.worker.kv_transfer.base import KVTransferConfig
from disagg.worker.kv_transfer.connectors import DEFAULT_LEASE_SECONDS  # extra config lease_seconds
from disagg.worker.kv_transfer.side_channel import EngineMetadata
from disagg.worker.ports import free_port

DEFAULT_READ_TIMEOUT_SECONDS = 10.0  # extra config read_timeout_seconds


@dataclass(frozen=True)
class NixlSettings:
    """The connector's extra config, read once (the keys are listed in nixl.py's docstring)."""

    engine_id: str
    lease_seconds: float  # prefill keeps unread KV this long
    handshake_timeout: float  # seconds for one side-channel fetch
    lease_margin: float  # decode does not start a READ this close to the lease's end
    read_timeout: float  # decode abandons a READ (or notification) not finished this long after its post
    bind_host: str  # side channel bind address
    port: int  # side channel port
    advertise_host: str  # what peers dial
    auth: Any = None  # handoff_auth.HandoffSigner: side-channel tokens and signed notifications; None: open

    @staticmethod
    def from_config(config: KVTransferConfig) -> NixlSettings:
        extra = config.kv_connector_extra_config
        bind_host = extra.get("side_channel_host", "127.0.0.1")
        if not extra.get("side_channel_port"):
            # both roles read this dict: the first one picks the port, the worker side binds it
            extra["side_channel_port"] = free_port(bind_host)
        advertise = extra.get("side_channel_advertise_host") or bind_host
        return NixlSettings(
            engine_id=config.engine_id,
            lease_seconds=float(extra.get("lease_seconds", DEFAULT_LEASE_SECONDS)),
            handshake_timeout=float(extra.get("handshake_timeout_seconds", 5)),
            lease_margin=float(extra.get("lease_margin_seconds", 1)),
            read_timeout=_positive(extra, "read_timeout_seconds", DEFAULT_READ_TIMEOUT_SECONDS),
            bind_host=bind_host,
            port=int(extra["side_channel_port"]),
            advertise_host=socket.gethostbyname(socket.gethostname()) if advertise == "0.0.0.0" else advertise,
            auth=config.auth,
        )


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
    releases: list[str] = field(default_factory=list)  # sends nobody will pull: free now (after this step's sends)


def lease_over(expires: float | None, margin: float) -> bool:
    """True when the sender may already have reused the blocks (`expires`: remote_lease_expires_at, wall clock;
    None: trust the sender)."""
    return expires is not None and time.time() > expires - margin


def read_expired(posted_at: float, now: float, timeout: float, lease_expires_at: float | None,
                 wall_now: float) -> str | None:
    """Why an unfinished READ must be abandoned now, or None.

    posted_at/now: time.monotonic(); lease_expires_at/wall_now: wall clock (time.time()). nixl exposes no
    per-transfer progress, so "no progress" is measured from the post: a READ of KV that fits in a lease
    moves in well under a second on any link the connector supports; one that has not finished after
    `timeout` is waiting on a peer that stopped answering (hung, partitioned). Past the lease the sender may
    have reused the blocks, so whatever the READ copies could be another request's KV."""
    if lease_expires_at is not None and wall_now > lease_expires_at:
        return "the prefill engine's lease on this KV ran out before the READ finished"
    if now - posted_at > timeout:
        return f"no answer from the prefill engine within read_timeout_seconds={timeout:g}"
    return None


def _positive(extra: dict, key: str, default: float) -> float:
    value = float(extra.get(key, default))
    if not value > 0:
        raise ValueError(f"kv_connector_extra_config.{key}={extra.get(key)!r}: expected a number of seconds > 0")
    return value

