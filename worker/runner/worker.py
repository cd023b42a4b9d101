"""The worker side of one engine (vLLM's Worker): picks the device, loads the model and readies the host for
it, sizes and allocates the paged KV cache, creates the worker-role connector and registers the cache with it,
then runs each scheduled step on the ModelRunner. Everything here touches devices or memory; the engine above
only schedules and turns token ids into text."""
from __future__ import annotations

import dataclasses
import logging

import torch

from disagg.worker.config import EngineConfig
from disagg.worker.kv_transfer.base import KVCacheSpec, KVConnectorRole
from disagg.worker.kv_transfer.factory import create_connector
from disagg.worker.model import load_model
from disagg.worker.outputs import ModelRunnerOutput, SchedulerOutput
from disagg.worker.runner.host_malloc import tune_malloc
from disagg.worker.runner.kv_cache_memory import KVPrefaulter, allocate_kv_cache, is_lazy_mapping
from disagg.worker.runner.model_runner import ModelRunner

logger = logging.getLogger(__name__)

CPU_KV_CACHE_BYTES = 1 << 30  # the KV cache's default size on CPU (CUDA: a share of free memory)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={name!r} but CUDA is not available")
    return device


def resolve_max_model_len(requested: int | None, max_position_embeddings: int) -> int:
    max_model_len = requested or max_position_embeddings
    if max_model_len > max_position_embeddings:
        raise ValueError(
            f"max_model_len={max_model_len} exceeds the model's max_position_embeddings={max_position_embeddings}"
        )
    return max_model_len


def num_kv_blocks(config: EngineConfig, max_model_len: int, bytes_per_block: int, device: torch.device) -> int:
    """KV blocks to allocate: config.num_kv_blocks, else as many as the memory budget holds; never fewer than
    one max_model_len request needs."""
    min_blocks = -(-max_model_len // config.block_size)
    if config.num_kv_blocks is not None:
        if config.num_kv_blocks < min_blocks:
            raise ValueError(
                f"num_kv_blocks={config.num_kv_blocks} cannot hold one max_model_len={max_model_len} "
                f"request (needs {min_blocks})"
            )
        return config.num_kv_blocks
    budget = config.kv_cache_memory_bytes
    if budget is None:
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            budget = int(free * config.gpu_memory_utilization)
        else:
            budget = CPU_KV_CACHE_BYTES
    return max(budget // bytes_per_block, min_blocks)


def prepare_cpu_model(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """The host allocator tuned for the step's allocation pattern; float32 weights packed for oneDNN."""
    tune_malloc()
    if dtype == torch.float32 and hasattr(model, "pack_weights"):
        logger.info("packed %d linear weights for oneDNN", model.pack_weights())


class Worker:
    def __init__(self, config: EngineConfig):
        self.device = resolve_device(config.device)
        self.model, self.model_config = load_model(config.model, dtype=config.dtype, device=self.device)
        self.dtype = next(self.model.parameters()).dtype
        if self.device.type == "cpu":
            prepare_cpu_model(self.model, self.dtype)
        mc = self.model_config
        self.max_model_len = resolve_max_model_len(config.max_model_len, mc.max_position_embeddings)
        spec = KVCacheSpec(
            model_name=config.served_model_name, num_layers=mc.num_hidden_layers,
            num_kv_heads=mc.num_key_value_heads, head_dim=mc.head_dim, block_size=config.block_size, num_blocks=0,
            dtype=str(self.dtype).removeprefix("torch."),
        )
        num_blocks = num_kv_blocks(config, self.max_model_len, spec.bytes_per_block, self.device)
        self.kv_cache_spec = dataclasses.replace(spec, num_blocks=num_blocks)
        self.kv_cache = allocate_kv_cache(
            (num_blocks, mc.num_hidden_layers, 2, config.block_size, mc.num_key_value_heads, mc.head_dim),
            self.dtype, self.device,
        )
        self.connector = create_connector(config.kv_transfer_config, KVConnectorRole.WORKER, self.kv_cache_spec)
        if self.connector is not None:
            self.connector.register_kv_caches({"kv_cache": self.kv_cache})
        self.model_runner = ModelRunner(self.model, self.kv_cache, config.block_size, self.device, self.connector,
                                        seed=config.seed)
        # a lazily mapped CPU cache: keep the blocks about to be used populated (see kv_cache_memory.py)
        self._prefaulter = KVPrefaulter(self.kv_cache, num_blocks) if is_lazy_mapping(self.kv_cache) else None

    def execute_model(self, so: SchedulerOutput, kv_high_water: int) -> ModelRunnerOutput:
        """kv_high_water: blocks [0, kv_high_water) have been handed out at least once (the prefaulter keeps
        populated ahead of them)."""
        if self._prefaulter is not None:
            self._prefaulter.advance(kv_high_water)
        return self.model_runner.execute_model(so)

    def shutdown(self) -> None:
        if self._prefaulter is not None:
            self._prefaulter.stop()
        if self.connector is not None:
            self.connector.shutdown()
