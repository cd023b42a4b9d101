"""Engine settings in one place (plain dataclass; the HTTP server and CLI fill it from flags). Below the
engine: its worker side (runner/worker.py) reads them too."""
from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from pathlib import Path

from disagg.worker.kv_transfer.base import KVTransferConfig


@dataclass
class EngineConfig:
    model: str  # checkpoint directory (config.json, *.safetensors, tokenizer.json)
    served_model_name: str | None = None  # name in the API; the directory name when not given
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    block_size: int = 16  # tokens per KV block
    num_kv_blocks: int | None = None  # KV blocks; derived from kv_cache_memory_bytes when None
    kv_cache_memory_bytes: int | None = None  # CPU default 1 GiB; CUDA default: gpu_memory_utilization
    gpu_memory_utilization: float = 0.9  # share of free GPU memory the KV cache may take
    max_model_len: int | None = None  # defaults to the model's max_position_embeddings
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    enable_kv_events: bool = False  # collect prefix-cache changes for LLMEngine.take_kv_events()
    seed: int = 0  # seeds sampling for requests without their own seed (per engine)
    kv_transfer_config: KVTransferConfig = field(default_factory=KVTransferConfig)

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 1, got {self.block_size}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype={self.dtype!r}: expected auto, float32, bfloat16 or float16")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        self.served_model_name = self.served_model_name or Path(self.model).name
        if not self.kv_transfer_config.engine_id:
            self.kv_transfer_config.engine_id = uuid.uuid4().hex
