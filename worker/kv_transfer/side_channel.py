"""Side channel: a tiny HTTP server that hands an engine's NIXL metadata to peers.

A decode engine learns a prefill engine's host and side-channel port from kv_transfer_params,
fetches `GET /metadata` once, and from then on talks to the prefill engine over NIXL only.
The body is JSON (agent metadata base64-encoded) carrying a protocol version, so two builds
that disagree on the wire format fail with a clear error instead of misreading fields.

With a hand-off key (handoff_auth.py) a request must carry the asking engine's NIXL agent name and a fresh
token for it (X-Disagg-Agent, X-Disagg-Token): a peer without the key gets a 403 and no metadata, so it cannot
load this engine's agent and READ its registered memory. Without a key anyone who reaches the port can.

Stdlib only (http.server / http.client): the worker must not pull a web stack into the
model-runner process just for this, and curl can read it when debugging.
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import http.client
import http.server
import json
import logging
import socket
import threading
from dataclasses import asdict, dataclass, field
from typing import Any

from disagg.worker.kv_transfer.base import KVCacheSpec
from disagg.worker.kv_transfer.handoff_auth import AGENT_HEADER, TOKEN_HEADER

logger = logging.getLogger(__name__)

PROTOCOL_VERSION = 1
METADATA_PATH = "/metadata"
# the KV-cache layout of base.py: one tensor for all layers, block-major
KV_LAYOUT = "blocks,layers,kv,block_size,kv_heads,head_dim"


class SideChannelError(Exception):
    """Any failure to obtain a peer's metadata; the message names host:port."""


class SideChannelUnreachable(SideChannelError):
    """Connection refused / reset / DNS failure."""


class SideChannelTimeout(SideChannelError):
    """The peer accepted nothing or answered nothing within the timeout."""


class MalformedMetadata(SideChannelError):
    """The peer answered, but not with metadata we can parse."""


class ProtocolVersionMismatch(SideChannelError):
    """The peer speaks another side-channel protocol version."""


class SideChannelForbidden(SideChannelError):
    """The peer refused our token (another hand-off key, or none where it wants one)."""


def compat_fields(
    model_name: str, dtype: str, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int,
    layout: str = KV_LAYOUT,
) -> dict[str, Any]:
    """What two engines must agree on for one's KV blocks to be valid in the other."""
    return {
        "model_name": model_name,
        "dtype": dtype,
        "num_layers": num_layers,
        "num_kv_heads": num_kv_heads,
        "head_dim": head_dim,
        "block_size": block_size,
        "layout": layout,
        "protocol_version": PROTOCOL_VERSION,
    }


def spec_compat_fields(spec: KVCacheSpec) -> dict[str, Any]:
    """compat_fields() of an engine's KV cache (its spec, this build's layout)."""
    return compat_fields(spec.model_name, spec.dtype, spec.num_layers, spec.num_kv_heads, spec.head_dim,
                         spec.block_size)


def compat_hash(fields: dict[str, Any]) -> str:
    """sha256 (hex, 16 chars) of the canonical JSON of compat_fields()."""
    canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class EngineMetadata:
    """Everything a peer needs to READ this engine's KV blocks over NIXL."""

    engine_id: str
    agent_name: str  # NIXL agent name; notifications arrive tagged with it
    agent_metadata: bytes  # nixl_agent.get_agent_metadata(); changes when the engine restarts
    kv_base_addr: int  # address of block 0 of the registered KV tensor
    bytes_per_block: int  # a block is contiguous across layers and K/V (block-major layout)
    num_blocks: int
    device_kind: str  # "DRAM" | "VRAM"
    device_id: int  # CUDA device index for VRAM, 0 for DRAM
    compat: dict[str, Any] = field(default_factory=dict)  # compat_fields(); includes dtype and layout
    compat_hash: str = ""  # compat_hash(compat)
    protocol_version: int = PROTOCOL_VERSION

    @property
    def dtype(self) -> str:
        return self.compat.get("dtype", "")

    @property
    def layout(self) -> str:
        return self.compat.get("layout", "")

    def to_json(self) -> bytes:
        body = asdict(self)
        body["agent_metadata"] = base64.b64encode(self.agent_metadata).decode("ascii")
        return json.dumps(body).encode()

    @classmethod
    def from_json(cls, raw: bytes, source: str = "peer") -> "EngineMetadata":
        """Parse and check the wire format; `source` (host:port) is named in every error."""
        try:
            body = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise MalformedMetadata(f"side channel {source}: body is not JSON ({e}): {raw[:80]!r}") from None
        if not isinstance(body, dict):
            raise MalformedMetadata(f"side channel {source}: expected a JSON object, got {type(body).__name__}")
        version = body.get("protocol_version")
        if version != PROTOCOL_VERSION:
            raise ProtocolVersionMismatch(
                f"side channel {source}: protocol_version={version!r}, expected {PROTOCOL_VERSION}"
            )
        try:
            body["agent_metadata"] = base64.b64decode(body["agent_metadata"], validate=True)
            md = cls(**body)
        except KeyError as e:
            raise MalformedMetadata(f"side channel {source}: missing field {e}") from None
        except (TypeError, binascii.Error) as e:
            raise MalformedMetadata(f"side channel {source}: bad metadata ({e})") from None
        _check_types(md, source)
        return md


def _check_types(md: EngineMetadata, source: str) -> None:
    expected = {
        "engine_id": str, "agent_name": str, "kv_base_addr": int, "bytes_per_block": int, "num_blocks": int,
        "device_kind": str, "device_id": int, "compat": dict, "compat_hash": str,
    }
    for name, typ in expected.items():
        value = getattr(md, name)
        if not isinstance(value, typ) or isinstance(value, bool):
            raise MalformedMetadata(
                f"side channel {source}: field {name}={value!r} should be {typ.__name__}"
            )
    if md.device_kind not in ("DRAM", "VRAM"):
        raise MalformedMetadata(f"side channel {source}: device_kind={md.device_kind!r}, expected DRAM or VRAM")


class _MetadataHandler(http.server.BaseHTTPRequestHandler):
    timeout = 5.0  # seconds a client may take to send its request; bounds handler threads
    server: "_MetadataHTTPServer"

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        if self.path != METADATA_PATH:
            self.send_error(404, f"only {METADATA_PATH} is served")
            return
        auth = self.server.auth
        agent = self.headers.get(AGENT_HEADER, "")
        if auth is not None and not auth.check_token(self.headers.get(TOKEN_HEADER, ""), "metadata", agent):
            logger.warning("side channel: refused %s (agent %r): no valid %s", self.address_string(), agent[:80],
                           TOKEN_HEADER)
            self.send_error(403, f"a valid {TOKEN_HEADER} for the {AGENT_HEADER} is required")
            return
        body = self.server.metadata.to_json()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        logger.debug("side channel %s: " + format, self.address_string(), *args)


class _MetadataHTTPServer(http.server.ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = True  # server_close() joins handler threads: nothing outlives close()
    metadata: EngineMetadata
    auth: Any  # handoff_auth.HandoffSigner, or None: anyone may read the metadata


class SideChannelServer:
    """Serves one EngineMetadata at http://host:port/metadata from a background thread.

    port=0 picks a free port; read the chosen one from `.port` after construction. `auth` (a HandoffSigner):
    only askers with a token of the same key get the metadata."""

    def __init__(self, metadata: EngineMetadata, host: str = "127.0.0.1", port: int = 0, auth: Any = None):
        self._httpd = _MetadataHTTPServer((host, port), _MetadataHandler)
        self._httpd.metadata = metadata
        self._httpd.auth = auth
        self.host = host
        self.port: int = self._httpd.server_address[1]
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.1},
            name=f"kv-side-channel-{self.port}", daemon=True,
        )
        self._thread.start()
        self._closed = False
        logger.info("KV side channel for engine %s on %s:%d", metadata.engine_id, host, self.port)

    def set_metadata(self, metadata: EngineMetadata) -> None:
        self._httpd.metadata = metadata  # one attribute swap: handlers see the old or the new, whole

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5.0)

    def __enter__(self) -> "SideChannelServer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def fetch_engine_metadata(host: str, port: int, timeout: float = 5.0, auth: Any = None,
                          agent: str = "") -> EngineMetadata:
    """GET the peer's metadata (as NIXL agent `agent`, with a token of `auth`'s key when given); raises a
    SideChannelError subclass naming host:port."""
    source = f"{host}:{port}"
    headers = {AGENT_HEADER: agent, TOKEN_HEADER: auth.token("metadata", agent)} if auth is not None else {}
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request("GET", METADATA_PATH, headers=headers)
        resp = conn.getresponse()
        raw = resp.read()
    except (socket.timeout, TimeoutError):
        raise SideChannelTimeout(f"side channel {source}: no answer within {timeout:.1f}s") from None
    except ConnectionRefusedError:
        raise SideChannelUnreachable(f"side channel {source}: connection refused (is the engine up?)") from None
    except (OSError, http.client.HTTPException) as e:
        raise SideChannelUnreachable(f"side channel {source}: {type(e).__name__}: {e}") from None
    finally:
        conn.close()
    if resp.status == 403:
        raise SideChannelForbidden(f"side channel {source}: our token was refused (HTTP 403): the prefill engine "
                                   "has another hand-off key, or this one has none")
    if resp.status != 200:
        raise MalformedMetadata(f"side channel {source}: HTTP {resp.status} {resp.reason}")
    return EngineMetadata.from_json(raw, source)
