"""What a NIXL READ must satisfy before it is posted, as pure functions, and the transport's errors.

nixl_transport.py applies these; they are tested directly, without nixl.
"""
from __future__ import annotations

from collections.abc import Sequence

from disagg.worker.kv_transfer.side_channel import EngineMetadata, compat_hash


class NixlTransportError(Exception):
    pass


class IncompatiblePeer(NixlTransportError):
    """The peer's KV blocks mean something else here (other model, dtype, shape or layout)."""


class InvalidBlockIds(NixlTransportError, ValueError):
    pass


class UnknownPeer(NixlTransportError):
    pass


class TransferFailed(NixlTransportError):
    """A READ failed. The local destination blocks may be partly written: treat them as invalid.

    nixl 1.5.1 reports failures as exceptions (e.g. nixlRemoteDisconnectError), not an "ERR"
    state; the original one is `cause` (also __cause__)."""

    def __init__(self, message: str, *, peer_engine_id: str, local_block_ids: list[int],
                 remote_block_ids: list[int], notif_msg: bytes, cause: BaseException | None):
        super().__init__(message)
        self.peer_engine_id = peer_engine_id
        self.local_block_ids = local_block_ids
        self.remote_block_ids = remote_block_ids
        self.notif_msg = notif_msg
        self.cause = cause


def coalesce(local_ids: Sequence[int], remote_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """(local_start, remote_start, nblocks) runs, in order, where both sides are consecutive."""
    if len(local_ids) != len(remote_ids):
        raise InvalidBlockIds(f"{len(local_ids)} local block ids but {len(remote_ids)} remote block ids")
    runs: list[tuple[int, int, int]] = []
    for local, remote in zip(local_ids, remote_ids):
        if runs:
            l0, r0, n = runs[-1]
            if local == l0 + n and remote == r0 + n:
                runs[-1] = (l0, r0, n + 1)
                continue
        runs.append((local, remote, 1))
    return runs


def check_block_ids(block_ids: Sequence[int], num_blocks: int, what: str) -> None:
    """Raise InvalidBlockIds naming every id that is negative, >= num_blocks, or repeated."""
    out_of_range = sorted({b for b in block_ids if not 0 <= b < num_blocks})
    seen: set[int] = set()
    duplicates = sorted({b for b in block_ids if b in seen or seen.add(b)})  # type: ignore[func-returns-value]
    problems = []
    if out_of_range:
        problems.append(f"out of range [0, {num_blocks}): {out_of_range}")
    if duplicates:
        problems.append(f"duplicated: {duplicates}")
    if problems:
        raise InvalidBlockIds(f"{what} block ids {'; '.join(problems)}")


def check_compatible(local: EngineMetadata, peer: EngineMetadata) -> None:
    """Raise IncompatiblePeer naming both hashes and each differing field."""
    if peer.compat_hash != compat_hash(peer.compat):
        raise IncompatiblePeer(
            f"peer engine {peer.engine_id}: compat hash {peer.compat_hash} does not match its own fields {peer.compat}"
        )
    differing = [
        f"{k} (local {local.compat.get(k)!r}, peer {peer.compat.get(k)!r})"
        for k in sorted(set(local.compat) | set(peer.compat)) if local.compat.get(k) != peer.compat.get(k)
    ]
    if peer.compat_hash != local.compat_hash or differing:
        raise IncompatiblePeer(
            f"peer engine {peer.engine_id}: compat hash {peer.compat_hash} != local {local.compat_hash}; "
            f"differs in {', '.join(differing) or 'nothing named (hash scheme differs)'}"
        )
    if peer.bytes_per_block != local.bytes_per_block:  # implied by the fields; checked since a READ trusts it
        raise IncompatiblePeer(
            f"peer engine {peer.engine_id}: bytes_per_block {peer.bytes_per_block} != local {local.bytes_per_block}"
        )
