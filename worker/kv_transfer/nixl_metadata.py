"""What the NIXL connector's two sides share: its settings and the step metadata the scheduler side
hands the worker side (plain dataclasses, no torch, no nixl)."""
from __future__ import annotations

import socket
import time
from dataclasses import dataclass, field

from disagg.worker.kv_transfer.base import KVTransferConfig
from disagg.worker.kv_transfer.connectors import DEFAULT_LEASE_SECONDS  # extra config lease_seconds
from disagg.worker.kv_transfer.side_channel import EngineMetadata



@dataclass(frozen=True)
class NixlSettings:
    """The connector's extra config, read once (the keys are listed in nixl.py's docstring)."""

    engine_id: str
    lease_seconds: float  # prefill keeps unread KV this long
    handshake_timeout: float  # seconds for one side-channel fetch
    lease_margin: float  # decode does not start a READ this close to the lease's end
    bind_host: str  # side channel bind address
    port: int  # side channel port
    advertise_host: str  # what peers dial

    @staticmethod
    def from_config(config: KVTransferConfig) -> NixlSettings:
        extra = config.kv_connector_extra_config
        bind_host = extra.get("side_channel_host", "127.0.0.1")
        if not extra.get("side_channel_port"):
            # both roles read this dict: the first one picks the port, the worker side binds it
            extra["side_channel_port"] = _free_port(bind_host)
        advertise = extra.get("side_channel_advertise_host") or bind_host
        return NixlSettings(
            engine_id=config.engine_id,
            lease_seconds=float(extra.get("lease_seconds", DEFAULT_LEASE_SECONDS)),
            handshake_timeout=float(extra.get("handshake_timeout_seconds", 5)),
            lease_margin=float(extra.get("lease_margin_seconds", 1)),
            bind_host=bind_host,
            port=int(extra["side_channel_port"]),
            advertise_host=socket.gethostbyname(socket.gethostname()) if advertise == "0.0.0.0" else advertise,
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


def lease_over(expires: float | None, margin: float) -> bool:
    """True when the sender may already have reused the blocks (`expires`: remote_lease_expires_at, wall clock;
    None: trust the sender)."""
    return expires is not None and time.time() > expires - margin


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host if host not in ("", "0.0.0.0") else "127.0.0.1", 0))
        return s.getsockname()[1]
