"""The NIXL connector's kv_transfer_params: one parser, used by the HTTP layer, the engine and the connector.

Pure (no torch, no nixl), so the HTTP layer can import it cheaply. What needs the engine's KV
layout (how many blocks a prompt fills, the peer's block count) is checked by the connector.

    {"do_remote_decode": true}                 prefill hop: keep the prompt's KV for a decode engine
    {"do_remote_prefill": true, remote_*...}   decode hop: READ the prompt's KV from that engine
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from disagg.worker.kv_transfer.base import KVTransferParamsError

# required with do_remote_prefill: name -> type
_REMOTE_FIELDS: dict[str, type] = {
    "remote_engine_id": str,
    "remote_block_ids": list,
    "remote_host": str,
    "remote_port": int,
    "remote_request_id": str,
}


class NixlParamsError(KVTransferParamsError):
    """A malformed field; `field` is its key ("remote_port"), or None when the combination is wrong."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field

    @property
    def param(self) -> str:
        """The field's path in a request body ("kv_transfer_params.remote_port")."""
        return f"kv_transfer_params.{self.field}" if self.field else "kv_transfer_params"


@dataclass(frozen=True)
class NixlParams:
    do_remote_decode: bool = False  # prefill hop: hold the prompt's blocks for a remote reader
    do_remote_prefill: bool = False  # decode hop: the fields below name where the prompt's KV is
    remote_engine_id: str = ""  # the prefill engine's id (a restarted engine has another)
    remote_block_ids: tuple[int, ...] = ()  # the prompt's blocks there, in prompt order
    remote_host: str = ""  # its side channel
    remote_port: int = 0
    remote_request_id: str = ""  # its id for the request; sent back as the READ's notification
    remote_lease_expires_at: float | None = None  # wall clock (time.time()) when it may reuse the blocks


def parse_nixl_params(params: dict[str, Any]) -> NixlParams:
    """kv_transfer_params -> NixlParams; raises NixlParamsError (a ValueError) naming the bad field.

    Unknown keys are ignored (a prefill engine also returns e.g. tp_size)."""
    if not isinstance(params, dict):
        raise NixlParamsError(f"kv_transfer_params must be an object, got {type(params).__name__}")
    for flag in ("do_remote_decode", "do_remote_prefill"):
        if flag in params and not isinstance(params[flag], bool):
            raise NixlParamsError(f"kv_transfer_params.{flag} must be a boolean, got {params[flag]!r}", flag)
    remote_decode, remote_prefill = params.get("do_remote_decode", False), params.get("do_remote_prefill", False)
    if remote_decode and remote_prefill:
        raise NixlParamsError("kv_transfer_params: do_remote_prefill and do_remote_decode are exclusive")
    if not remote_prefill:
        return NixlParams(do_remote_decode=remote_decode)
    for key, typ in _REMOTE_FIELDS.items():
        value = params.get(key)
        if not isinstance(value, typ) or isinstance(value, bool) or (typ is str and not value):
            raise NixlParamsError(
                f"kv_transfer_params.{key} must be a non-empty {typ.__name__} with do_remote_prefill, got {value!r}",
                key)
    port = params["remote_port"]
    if not 0 < port < 65536:
        raise NixlParamsError(f"kv_transfer_params.remote_port {port} is not a TCP port", "remote_port")
    ids = params["remote_block_ids"]
    if not all(_is_int(b) and b >= 0 for b in ids) or len(set(ids)) != len(ids):
        raise NixlParamsError(
            f"kv_transfer_params.remote_block_ids must be distinct non-negative integers, got {ids[:16]!r}",
            "remote_block_ids")
    expires = params.get("remote_lease_expires_at")
    if expires is not None and not (_is_int(expires) or isinstance(expires, float)):
        raise NixlParamsError(f"kv_transfer_params.remote_lease_expires_at must be a number, got {expires!r}",
                              "remote_lease_expires_at")
    return NixlParams(
        do_remote_prefill=True,
        remote_engine_id=params["remote_engine_id"],
        remote_block_ids=tuple(ids),
        remote_host=params["remote_host"],
        remote_port=port,
        remote_request_id=params["remote_request_id"],
        remote_lease_expires_at=None if expires is None else float(expires),
    )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
