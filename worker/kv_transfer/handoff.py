"""The P/D hand-off: `kv_transfer_params`, typed. The only code that knows its keys (vLLM's wire keys).

    Handoff(do_remote_decode=True)                     prefill hop: keep the prompt's KV for a decode engine
    Handoff(do_remote_prefill=True, remote=RemoteKV)   decode hop: the prompt's KV is at `remote`
    output_token_ids                                   what the prefill sampled (a router may stream it first)
    delivered_token_ids                                the client has these already; the decode continues after

Keys this module does not know (vLLM's tp_size, remote_num_tokens ...; an out-of-tree connector's own) pass
through untouched in `extra`, so a router carries any engine's hand-off unchanged. A connector declares the
extra keys it reads and their types (connectors.ConnectorDeclaration.handoff_fields); `parse` checks them.
Pure: no torch, no nixl (the HTTP layer and the router import it).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from disagg.worker.kv_transfer.base import KVTransferParamsError

# the layout of the remote block ids: ours is flat; vLLM's is one list per KV-cache group ([[1, 2, ...]])
BlockIds = tuple[int, ...] | tuple[tuple[int, ...], ...]
_FLAGS = ("do_remote_decode", "do_remote_prefill")
_TOKEN_LISTS = ("output_token_ids", "delivered_token_ids")
# with do_remote_prefill: wire key -> (RemoteKV field, type)
_REMOTE_FIELDS: dict[str, tuple[str, type]] = {
    "remote_engine_id": ("engine_id", str),
    "remote_block_ids": ("block_ids", list),
    "remote_host": ("host", str),
    "remote_port": ("port", int),
    "remote_request_id": ("request_id", str),
}
LEASE_KEY = "remote_lease_expires_at"
SIGNATURE_KEY = "disagg_signature"  # the prefill side's signature over the remote fields (handoff_auth.py)


class HandoffError(KVTransferParamsError):
    """A malformed hand-off; `field` is its key ("remote_port"), or None when the combination is wrong."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field

    @property
    def param(self) -> str:
        """The field's path in a request body ("kv_transfer_params.remote_port")."""
        return f"kv_transfer_params.{self.field}" if self.field else "kv_transfer_params"


@dataclass(frozen=True)
class RemoteKV:
    """Where a prompt's KV waits to be read: the prefill engine's blocks and side channel."""
    engine_id: str  # the prefill engine's id (a restarted engine has another)
    block_ids: BlockIds  # the prompt's blocks there, in prompt order
    host: str  # its side channel
    port: int
    request_id: str  # its id for the request; sent back as the READ's notification
    lease_expires_at: float | None = None  # wall clock (time.time()) after which it may reuse the blocks


@dataclass(frozen=True)
class Handoff:
    # None: the key is absent on the wire (kept absent, so a hand-off round-trips unchanged)
    do_remote_decode: bool | None = None  # prefill hop: hold the prompt's blocks for a remote reader
    do_remote_prefill: bool | None = None  # decode hop: `remote` names where the prompt's KV is
    remote: RemoteKV | None = None  # set exactly when do_remote_prefill
    output_token_ids: tuple[int, ...] = ()  # the prefill's sampled token(s)
    delivered_token_ids: tuple[int, ...] = ()  # already streamed to the client; the decode continues after
    signature: str | None = None  # "v1:<resource>:<hex HMAC>" over `remote` (handoff_auth.py)
    extra: Mapping[str, Any] = field(default_factory=dict)  # keys of other engines and connectors, untouched

    # ---------------------------------------------------------------- constructors
    @classmethod
    def prefill_request(cls) -> Handoff:
        """What a router sends with the prefill hop."""
        return cls(do_remote_decode=True)

    @classmethod
    def parse(cls, params: Any, extra_types: Mapping[str, type] | None = None) -> Handoff:
        """kv_transfer_params (JSON) -> Handoff; raises HandoffError (a ValueError) naming the bad field.
        `extra_types`: keys a connector reads beyond these, checked when present."""
        if isinstance(params, Handoff):
            return params
        if not isinstance(params, dict):
            raise HandoffError(f"kv_transfer_params must be an object, got {type(params).__name__}")
        for flag in _FLAGS:
            if flag in params and not isinstance(params[flag], bool):
                raise HandoffError(f"kv_transfer_params.{flag} must be a boolean, got {params[flag]!r}", flag)
        if params.get("do_remote_decode") and params.get("do_remote_prefill"):
            raise HandoffError("kv_transfer_params: do_remote_prefill and do_remote_decode are exclusive")
        tokens = {name: _token_list(params, name) for name in _TOKEN_LISTS}
        remote = _parse_remote(params) if params.get("do_remote_prefill") else None
        signature = params.get(SIGNATURE_KEY)
        if signature is not None and not (isinstance(signature, str) and signature):
            raise HandoffError(f"kv_transfer_params.{SIGNATURE_KEY} must be a non-empty string, got {signature!r:.80}",
                               SIGNATURE_KEY)
        known = {*_FLAGS, *_TOKEN_LISTS, SIGNATURE_KEY, *((*_REMOTE_FIELDS, LEASE_KEY) if remote else ())}
        extra = {k: v for k, v in params.items() if k not in known}
        for key, typ in (extra_types or {}).items():
            if key in extra and (not isinstance(extra[key], typ) or isinstance(extra[key], bool) and typ is not bool):
                raise HandoffError(f"kv_transfer_params.{key} must be {typ.__name__}, got {extra[key]!r}", key)
        return cls(params.get("do_remote_decode"), params.get("do_remote_prefill"), remote,
                   tokens["output_token_ids"], tokens["delivered_token_ids"], signature, extra)

    # ---------------------------------------------------------------- derived hand-offs
    def with_output(self, token_ids: list[int]) -> Handoff:
        """The prefill's answer: these params plus the token(s) it sampled."""
        return dataclasses.replace(self, output_token_ids=tuple(token_ids))

    def delivering(self, token_ids: tuple[int, ...]) -> Handoff:
        """The decode hop after `token_ids` reached the client: the decode engine continues after them."""
        return dataclasses.replace(self, delivered_token_ids=tuple(token_ids))

    @classmethod
    def delivered_only(cls, token_ids: tuple[int, ...]) -> Handoff:
        """Decoding alone (no KV to read) after `token_ids` reached the client."""
        return cls(delivered_token_ids=tuple(token_ids))

    # ---------------------------------------------------------------- reading
    @property
    def is_prefill_hop(self) -> bool:
        return bool(self.do_remote_decode)

    @property
    def reads_remote_kv(self) -> bool:
        return self.remote is not None

    def get(self, key: str, default: Any = None) -> Any:
        """A wire key's value, as vLLM's connectors read their params dict (`params.get(...)`)."""
        return self.to_wire().get(key, default)

    def to_wire(self) -> dict[str, Any]:
        """The JSON object, in vLLM's keys."""
        out: dict[str, Any] = {}
        for flag in _FLAGS:
            if getattr(self, flag) is not None:
                out[flag] = getattr(self, flag)
        if self.remote is not None:
            r = self.remote
            ids = [list(g) for g in r.block_ids] if r.block_ids and isinstance(r.block_ids[0], tuple) \
                else list(r.block_ids)
            out.update(remote_engine_id=r.engine_id, remote_block_ids=ids, remote_host=r.host,
                       remote_port=r.port, remote_request_id=r.request_id)
            if r.lease_expires_at is not None:
                out[LEASE_KEY] = r.lease_expires_at
        if self.signature is not None:
            out[SIGNATURE_KEY] = self.signature
        out.update(self.extra)
        for name in _TOKEN_LISTS:
            if getattr(self, name):
                out[name] = list(getattr(self, name))
        return out


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _token_list(params: dict[str, Any], name: str) -> tuple[int, ...]:
    if name not in params:
        return ()
    ids = params[name]
    if not isinstance(ids, list) or not ids or not all(_is_int(t) and t >= 0 for t in ids):
        raise HandoffError(f"kv_transfer_params.{name} must be a non-empty list of token ids, got {ids!r:.80}", name)
    return tuple(ids)


def _parse_remote(params: dict[str, Any]) -> RemoteKV:
    values = {}
    for key, (attr, typ) in _REMOTE_FIELDS.items():
        value = params.get(key)
        if not isinstance(value, typ) or isinstance(value, bool) or (typ is str and not value):
            raise HandoffError(
                f"kv_transfer_params.{key} must be a non-empty {typ.__name__} with do_remote_prefill, got {value!r}",
                key)
        values[attr] = value
    if not 0 < values["port"] < 65536:
        raise HandoffError(f"kv_transfer_params.remote_port {values['port']} is not a TCP port", "remote_port")
    values["block_ids"] = _block_ids(values["block_ids"])
    expires = params.get(LEASE_KEY)
    if expires is not None and not (_is_int(expires) or isinstance(expires, float)):
        raise HandoffError(f"kv_transfer_params.{LEASE_KEY} must be a number, got {expires!r}", LEASE_KEY)
    return RemoteKV(**values, lease_expires_at=None if expires is None else float(expires))


def _block_ids(ids: list[Any]) -> BlockIds:
    """Flat distinct non-negative ints, or (vLLM) one such list per KV-cache group."""
    groups = ids if ids and all(isinstance(g, list) for g in ids) else [ids]
    for group in groups:
        if not all(_is_int(b) and b >= 0 for b in group) or len(set(group)) != len(group):
            raise HandoffError(
                f"kv_transfer_params.remote_block_ids must be distinct non-negative integers, got {ids[:16]!r}",
                "remote_block_ids")
    return tuple(tuple(g) for g in ids) if groups is ids else tuple(ids)
