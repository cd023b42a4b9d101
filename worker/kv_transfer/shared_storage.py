"""Reference connector that needs no network: KV blocks saved to / loaded from a directory.

The producer saves the KV of a prompt's full blocks (all but the last prompt token, aligned down
to a block) in one safetensors file named by the hash of those tokens; a consumer whose prompt
has the same tokens loads them synchronously before its forward pass and computes only the rest.
Point two engine processes (prefill, decode) at one directory to get P/D without NIXL.

extra config: {"shared_storage_path": DIR}
"""
from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from disagg.worker.kv_transfer.base import (
    KVCacheSpec, KVConnectorBase, KVConnectorRole, KVTransferConfig, kv_bytes_loaded, kv_bytes_saved,
)

if TYPE_CHECKING:
    import torch

    from disagg.worker.outputs import ConnectorRequest, SchedulerOutput

logger = logging.getLogger(__name__)


@dataclass
class _Transfer:
    req_id: str
    key: str  # file stem: hash of the prompt tokens covered
    block_ids: list[int]  # local blocks, in token order
    first_block: int  # index (in the file) of block_ids[0]


@dataclass
class SharedStorageMetadata:
    loads: list[_Transfer] = field(default_factory=list)
    saves: list[_Transfer] = field(default_factory=list)


class SharedStorageConnector(KVConnectorBase):
    metrics = (kv_bytes_loaded("bytes_loaded"), kv_bytes_saved("bytes_saved"))

    def __init__(self, config: KVTransferConfig, role: KVConnectorRole, kv_cache_spec: KVCacheSpec):
        super().__init__(config, role, kv_cache_spec)
        path = config.kv_connector_extra_config.get("shared_storage_path")
        if not path:
            raise ValueError("SharedStorageConnector needs kv_connector_extra_config['shared_storage_path']")
        self.root = Path(path)
        self.root.mkdir(parents=True, exist_ok=True)
        self.block_size = kv_cache_spec.block_size
        # scheduler side
        self._pending_loads: list[_Transfer] = []
        self._unsaved: dict[str, tuple[list[int], list[int]]] = {}  # req_id -> (prompt ids, block ids)
        # worker side
        self._kv_cache: torch.Tensor | None = None
        self._load_errors: set[int] = set()
        self._stats = {"bytes_loaded": 0, "bytes_saved": 0, "num_loads": 0, "num_saves": 0}

    # ---------------- shared helpers
    def _aligned_tokens(self, prompt_token_ids: list[int]) -> int:
        return (len(prompt_token_ids) - 1) // self.block_size * self.block_size

    def _key(self, token_ids: list[int]) -> str:
        h = hashlib.sha256(self._compat_tag().encode())
        h.update(b"".join(int(t).to_bytes(4, "little") for t in token_ids))
        return h.hexdigest()

    def _compat_tag(self) -> str:
        s = self.kv_cache_spec
        return f"{s.model_name}|{s.num_layers}|{s.num_kv_heads}|{s.head_dim}|{s.block_size}|{s.dtype}"

    def _path(self, key: str) -> Path:
        return self.root / f"{key}.safetensors"

    # ---------------- scheduler role
    def get_num_new_matched_tokens(self, request: "ConnectorRequest",
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        if self.config.kv_role == "kv_producer" or request.num_output_tokens:
            return 0, False
        n = self._aligned_tokens(request.prompt_token_ids)
        if n <= num_computed_tokens or not self._path(self._key(request.prompt_token_ids[:n])).exists():
            return 0, False
        return n - num_computed_tokens, False

    def update_state_after_alloc(self, request: "ConnectorRequest",
                                 block_ids: list[int], num_external_tokens: int) -> None:
        if num_external_tokens:
            n = self._aligned_tokens(request.prompt_token_ids)
            first = (n - num_external_tokens) // self.block_size
            key = self._key(request.prompt_token_ids[:n])
            self._pending_loads.append(_Transfer(request.request_id, key, block_ids[first : n // self.block_size], first))
        elif self.config.kv_role != "kv_consumer" and self._aligned_tokens(request.prompt_token_ids):
            self._unsaved[request.request_id] = (request.prompt_token_ids, block_ids)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> SharedStorageMetadata:
        meta = SharedStorageMetadata(loads=self._pending_loads)
        self._pending_loads = []
        for req_id in scheduler_output.finished_req_ids | scheduler_output.preempted_req_ids:
            self._unsaved.pop(req_id, None)
        new = {r.req_id: r for r in scheduler_output.scheduled_new_reqs}
        cached = {r.req_id: r for r in scheduler_output.scheduled_cached_reqs}
        for req_id, (prompt, blocks) in list(self._unsaved.items()):
            if req_id not in scheduler_output.num_scheduled_tokens:
                continue
            start = new[req_id].num_computed_tokens if req_id in new else cached[req_id].num_computed_tokens
            if req_id in cached:
                blocks.extend(cached[req_id].new_block_ids)
            n = self._aligned_tokens(prompt)
            if start + scheduler_output.num_scheduled_tokens[req_id] >= n:  # prompt blocks complete this step
                del self._unsaved[req_id]
                key = self._key(prompt[:n])
                if not self._path(key).exists():
                    meta.saves.append(_Transfer(req_id, key, list(blocks[: n // self.block_size]), 0))
        return meta

    def request_finished(self, request: "ConnectorRequest", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._unsaved.pop(request.request_id, None)
        return False, None

    # ---------------- worker role
    def register_kv_caches(self, kv_caches: dict[str, "torch.Tensor"]) -> None:
        self._kv_cache = kv_caches["kv_cache"]

    def start_load_kv(self, **kwargs: Any) -> None:
        import torch
        from safetensors.torch import load_file

        meta: SharedStorageMetadata = self._get_connector_metadata()
        for t in meta.loads:
            try:
                data = load_file(str(self._path(t.key)), device=str(self._kv_cache.device))["kv"]
                part = data[t.first_block : t.first_block + len(t.block_ids)]
                expected = (len(t.block_ids), *self._kv_cache.shape[1:])
                if tuple(part.shape) != expected or part.dtype != self._kv_cache.dtype:
                    raise ValueError(f"stored KV has shape {tuple(part.shape)} {part.dtype}, expected {expected}")
                idx = torch.tensor(t.block_ids, device=self._kv_cache.device)
                self._kv_cache.index_copy_(0, idx, part)
                self._stats["bytes_loaded"] += part.numel() * part.element_size()
                self._stats["num_loads"] += 1
            except Exception as e:  # noqa: BLE001 - any failure invalidates exactly these blocks
                logger.error("loading KV for %s from %s failed: %s", t.req_id, self._path(t.key), e)
                self._load_errors.update(t.block_ids)

    def wait_for_save(self) -> None:
        from safetensors.torch import save_file

        meta: SharedStorageMetadata = self._get_connector_metadata()
        for t in meta.saves:
            data = self._kv_cache[t.block_ids].contiguous().cpu()
            tmp = self._path(t.key).with_suffix(f".tmp{os.getpid()}")
            save_file({"kv": data}, str(tmp), metadata={"compat": self._compat_tag()})
            os.replace(tmp, self._path(t.key))  # readers never see a partial file
            self._stats["bytes_saved"] += data.numel() * data.element_size()
            self._stats["num_saves"] += 1

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def get_kv_connector_stats(self) -> dict[str, Any] | None:
        if not any(self._stats.values()):
            return None
        stats = dict(self._stats)
        self._stats = dict.fromkeys(self._stats, 0)
        return stats
