"""Authenticated P/D hand-off: the prefill side signs what it hands out, the decode side checks before it connects.

A hand-off names a host and port the decode worker connects to and block ids it READs there. Unsigned, anyone
who reaches a decode worker could point it anywhere (a connection to any host) or at another request's blocks
(its prompt). So the prefill side signs, with a key shared by the pods of one resource (a Secret the operator
creates, or one named in the spec; `disagg up` makes one per run), an HMAC-SHA256 over what the decode side acts
on: the engine id, request id, block ids, host, port and lease end, and the resource's name. The decode side
rejects a missing, forged, expired, replayed or other-resource signature before any connection.

    signature = "v1:<resource>:<hex HMAC-SHA256(key, canonical JSON of the signed fields)>"

The same key authenticates the NIXL side channel and notifications (`token`, `check_token`): a peer without it
gets no agent metadata (so cannot READ registered memory) and cannot end another request's send.
Pure: hashlib/hmac only.
"""
from __future__ import annotations

import base64
import binascii
import dataclasses
import hashlib
import heapq
import hmac
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from disagg.worker.kv_transfer.handoff import LEASE_KEY, SIGNATURE_KEY, Handoff, RemoteKV

VERSION = "v1"
KEY_ENV = "DISAGG_HANDOFF_KEY"  # the key, base64 (what a Secret's value is); or a file path in KEY_FILE_ENV
KEY_FILE_ENV = "DISAGG_HANDOFF_KEY_FILE"
RESOURCE_ENV = "DISAGG_HANDOFF_RESOURCE"  # "<namespace>/<name>" of the resource the pods serve
MIN_KEY_BYTES = 16
TOKEN_SKEW_S = 60.0  # a side-channel token older (or newer) than this is refused
# GET /metadata of the NIXL side channel: who asks (its NIXL agent name) and its token("metadata", that name)
AGENT_HEADER = "X-Disagg-Agent"
TOKEN_HEADER = "X-Disagg-Token"


class HandoffRejected(ValueError):
    """The hand-off may not be acted on. `status` is the HTTP answer (403: not ours; 400: malformed)."""

    def __init__(self, message: str, status: int = 403, field: str = SIGNATURE_KEY):
        super().__init__(message)
        self.status, self.field = status, field

    @property
    def param(self) -> str:
        return f"kv_transfer_params.{self.field}"


def _canonical(resource: str, remote: RemoteKV) -> bytes:
    ids = [list(g) for g in remote.block_ids] if remote.block_ids and isinstance(remote.block_ids[0], tuple) \
        else list(remote.block_ids)
    fields = [VERSION, resource, remote.engine_id, remote.request_id, ids, remote.host, remote.port,
              remote.lease_expires_at]
    return json.dumps(fields, separators=(",", ":")).encode()


@dataclass
class HandoffSigner:
    key: bytes = field(repr=False)
    resource: str  # "<namespace>/<name>" (or the local run's name)
    _seen: set[str] = field(default_factory=set, repr=False)  # signatures acted on whose lease runs (replays)
    _ends: list[tuple[float, str]] = field(default_factory=list, repr=False)  # heap: (lease end, signature)

    def __post_init__(self) -> None:
        if len(self.key) < MIN_KEY_BYTES:
            raise ValueError(f"the hand-off key has {len(self.key)} bytes; at least {MIN_KEY_BYTES} are needed")
        if not self.resource or ":" in self.resource:
            raise ValueError(f"the hand-off resource name {self.resource!r} must be non-empty and without ':'")

    def _mac(self, resource: str, remote: RemoteKV) -> str:
        return hmac.new(self.key, _canonical(resource, remote), hashlib.sha256).hexdigest()

    def sign(self, handoff: Handoff) -> Handoff:
        """The hand-off a prefill worker returns, signed. Needs the remote KV and its lease end."""
        if handoff.remote is None or handoff.remote.lease_expires_at is None:
            raise ValueError("only a hand-off naming remote KV and its lease end can be signed")
        return dataclasses.replace(handoff, signature=f"{VERSION}:{self.resource}:{self._mac(self.resource, handoff.remote)}")

    def verify(self, handoff: Handoff, now: float | None = None) -> None:
        """Raise HandoffRejected unless this resource's prefill side signed this hand-off, its lease is still
        running and it was not acted on before (by this worker). Nothing is contacted."""
        remote = handoff.remote
        if remote is None:
            return  # nothing to connect to
        now = time.time() if now is None else now
        if handoff.signature is None:
            raise HandoffRejected(f"kv_transfer_params.{SIGNATURE_KEY} is missing: this worker reads KV only from "
                                  f"hand-offs signed by a prefill worker of {self.resource}")
        version, _, rest = handoff.signature.partition(":")
        resource, _, mac = rest.rpartition(":")
        if version != VERSION or not resource or not mac:
            raise HandoffRejected(f"kv_transfer_params.{SIGNATURE_KEY} is not a {VERSION} signature")
        if resource != self.resource:
            raise HandoffRejected(f"kv_transfer_params.{SIGNATURE_KEY} was made for {resource}, not for "
                                  f"{self.resource}: KV is handed only between pods of one resource")
        if remote.lease_expires_at is None:
            raise HandoffRejected(f"kv_transfer_params.{LEASE_KEY} is required", status=400, field=LEASE_KEY)
        if not hmac.compare_digest(mac, self._mac(resource, remote)):
            raise HandoffRejected(f"kv_transfer_params.{SIGNATURE_KEY} does not match the hand-off: it was "
                                  "changed or forged")
        if remote.lease_expires_at <= now:
            raise HandoffRejected(f"kv_transfer_params.{LEASE_KEY}: the prefill's lease on this KV ended "
                                  f"{now - remote.lease_expires_at:.1f} s ago; its blocks may hold other data now",
                                  field=LEASE_KEY)
        self._forget(now)
        if handoff.signature in self._seen:
            raise HandoffRejected(f"kv_transfer_params.{SIGNATURE_KEY}: this hand-off was used already (a replay)")
        self._seen.add(handoff.signature)
        heapq.heappush(self._ends, (remote.lease_expires_at, handoff.signature))

    def sign_params(self, params: dict) -> dict:
        """A prefill answer's kv_transfer_params (JSON), signed when they name remote KV with a lease end;
        anything else (no remote KV) unchanged."""
        handoff = Handoff.parse(params)
        if handoff.remote is None or handoff.remote.lease_expires_at is None:
            return params
        return self.sign(handoff).to_wire()

    def _forget(self, now: float) -> None:
        """Drop the signatures whose lease ended (an expired hand-off is refused anyway): O(log n) each, so a
        decode worker's check costs the same at any request rate."""
        while self._ends and self._ends[0][0] <= now:
            self._seen.discard(heapq.heappop(self._ends)[1])

    # ---------------------------------------------------------------- side channel and notifications
    def token(self, purpose: str, subject: str, now: float | None = None) -> str:
        """`<unix seconds>:<hex HMAC>` proving the key for (purpose, subject), e.g. ("metadata", agent name)."""
        ts = f"{time.time() if now is None else now:.3f}"
        mac = hmac.new(self.key, f"{VERSION}|{self.resource}|{purpose}|{subject}|{ts}".encode(), hashlib.sha256)
        return f"{ts}:{mac.hexdigest()}"

    def check_token(self, token: str, purpose: str, subject: str, now: float | None = None) -> bool:
        ts, _, mac = token.partition(":")
        try:
            age = (time.time() if now is None else now) - float(ts)
        except ValueError:
            return False
        expected = hmac.new(self.key, f"{VERSION}|{self.resource}|{purpose}|{subject}|{ts}".encode(),
                            hashlib.sha256).hexdigest()
        return abs(age) <= TOKEN_SKEW_S and hmac.compare_digest(mac, expected)

    def notification(self, request_id: str, agent: str, now: float | None = None) -> bytes:
        """The message a READ carries to the prefill side: the request id, and a token that only a holder of
        the key can make for (request id, the reading agent's NIXL name)."""
        return f"{VERSION}|{self.token('notif', _pair(request_id, agent), now)}|{request_id}".encode()

    def check_notification(self, msg: bytes, sender: str, now: float | None = None) -> str | None:
        """The request id a notification from NIXL agent `sender` releases, or None when it is not one of
        `notification`'s for that very agent (a stranger's, or another agent's token replayed)."""
        version, _, rest = msg.decode("utf-8", "replace").partition("|")
        token, _, request_id = rest.partition("|")
        if version != VERSION or not request_id:
            return None
        return request_id if self.check_token(token, "notif", _pair(request_id, sender), now) else None


def _pair(request_id: str, agent: str) -> str:
    return json.dumps([request_id, agent])  # unambiguous whatever either contains


def decode_key(text: str, source: str) -> bytes:
    try:
        return base64.b64decode(text.strip(), validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"{source}: the hand-off key must be base64") from None


def signer_from_env(environ: dict[str, str] | None = None) -> HandoffSigner | None:
    """The signer the pod's environment configures (the Secret as $DISAGG_HANDOFF_KEY or a file), else None."""
    env = os.environ if environ is None else environ
    if env.get(KEY_FILE_ENV):
        key = decode_key(Path(env[KEY_FILE_ENV]).read_text(), env[KEY_FILE_ENV])
    elif env.get(KEY_ENV):
        key = decode_key(env[KEY_ENV], KEY_ENV)
    else:
        return None
    return HandoffSigner(key, env.get(RESOURCE_ENV) or "default")


def new_key() -> str:
    """A fresh key, base64 (32 random bytes), as the operator writes into a Secret and `disagg up` exports."""
    return base64.b64encode(os.urandom(32)).decode()
