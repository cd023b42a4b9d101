"""load_model: a Hugging Face checkpoint directory (config.json + *.safetensors) -> the registered model.

The model is built on the meta device (no memory), then each parameter is materialised from
its safetensors tensor one at a time, so at most one extra tensor exists beside the model.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open

from disagg.worker.model.config import DTYPE_NAMES, ModelConfig
from disagg.worker.model.registry import model_class

logger = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"


def resolve_dtype(dtype: str | torch.dtype | None, config: ModelConfig) -> torch.dtype:
    """None -> float32; "auto" -> the checkpoint's dtype; otherwise the named dtype."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None:
        return torch.float32
    name = config.dtype if dtype == "auto" else dtype
    if name not in DTYPE_NAMES:
        raise ValueError(f"dtype={dtype!r}: expected None, 'auto' or one of {', '.join(DTYPE_NAMES)}")
    return getattr(torch, name)


def load_model(
    model_dir: str | Path, dtype: str | torch.dtype | None = None, device: str | torch.device = "cpu"
) -> tuple[torch.nn.Module, ModelConfig]:
    model_dir = Path(model_dir)
    config = ModelConfig.from_dir(model_dir)
    torch_dtype = resolve_dtype(dtype, config)
    with torch.device("meta"):
        model = model_class(config.architecture)(config)
    files = _weight_files(model_dir)
    expected = _expected_names(model)
    found: set[str] = set()
    unexpected: list[str] = []
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                if name.endswith("rotary_emb.inv_freq"):
                    continue  # recomputed from the config
                if name == "lm_head.weight" and config.tie_word_embeddings:
                    continue  # some tied checkpoints store the shared matrix twice
                if name not in expected:
                    unexpected.append(name)
                    continue
                _assign(model, name, f.get_tensor(name), torch_dtype, device)
                found.add(name)
    if unexpected:
        raise ValueError(f"unexpected tensors in {str(model_dir)!r}: {', '.join(sorted(unexpected)[:20])}")
    missing = sorted(set(expected) - found)
    if missing:
        raise ValueError(f"missing tensors in {str(model_dir)!r}: {', '.join(missing[:20])}")
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    if hasattr(model, "fuse_projections"):  # after the checks: the checkpoint's names are the unfused ones
        model.fuse_projections()
    model.eval()
    logger.info("loaded %s from %s (%s, %s)", config.architecture, model_dir, torch_dtype, device)
    return model, config


def _weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / INDEX_FILE
    if index.is_file():
        with index.open() as f:
            weight_map: dict[str, str] = json.load(f)["weight_map"]
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        absent = [str(p) for p in files if not p.is_file()]
        if absent:
            raise FileNotFoundError(f"{INDEX_FILE} names shard files that do not exist: {', '.join(absent)}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weight files in model directory {str(model_dir)!r}")
    return files


def _expected_names(model: torch.nn.Module) -> dict[str, torch.Size]:
    # named_parameters() lists a tied lm_head.weight once, under embed_tokens
    return {name: p.shape for name, p in model.named_parameters()}


def _assign(model: torch.nn.Module, name: str, tensor: torch.Tensor, dtype: torch.dtype, device: str | torch.device) -> None:
    module_path, _, attr = name.rpartition(".")
    module = model.get_submodule(module_path)
    current = getattr(module, attr)
    if tensor.shape != current.shape:
        raise ValueError(
            f"tensor {name!r}: checkpoint shape {tuple(tensor.shape)} != model shape {tuple(current.shape)}"
        )
    setattr(module, attr, torch.nn.Parameter(tensor.to(device=device, dtype=dtype), requires_grad=False))
