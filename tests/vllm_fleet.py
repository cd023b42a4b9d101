"""vLLM's CPU build for tests outside the vLLM tier too (the live-Prometheus dashboard test): where its executable
is, the tiny checkpoint it runs, and a P/D spec whose workers are planned as `disagg up` plans them."""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

VLLM_ENV = "DISAGG_VLLM"  # the `vllm` executable (the launcher .ci/install-vllm.sh writes)
SKIP_REASON = (f"{VLLM_ENV} is not set: run .ci/install-vllm.sh and export {VLLM_ENV}=<the path it prints> "
               "to run the vLLM tier")
# what vLLM's CPU build needs on a small machine: a bounded KV cache (GiB). `disagg up` gives each vLLM process
# cores of its own (launcher.vllm_cpu_bind); one vLLM alone binds to every core
ENGINE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}
STARTUP_S = 400  # two or three vLLM processes starting on two cores
ENGINE_ARGS = ["--enforce-eager", "--max-num-seqs", "16"]  # eager: starts faster, same tokens


def vllm_executable() -> str | None:
    """The executable $DISAGG_VLLM names, or None when it is unset."""
    named = os.environ.get(VLLM_ENV)
    return shutil.which(named) if named else None


def write_vllm_checkpoint(path: Path) -> str:
    """A tiny random Llama vLLM's CPU attention runs (head size 64), with our word-level tokenizer."""
    from disagg.worker.model import write_tiny_checkpoint

    return str(write_tiny_checkpoint(path, hidden_size=256, num_heads=4, num_kv_heads=2, intermediate_size=512,
                                     num_layers=2))


def pd_spec(model_dir: str, served_name: str, **spec: Any) -> dict[str, Any]:
    """spec of an engine-vllm resource, 1 prefill + 1 decode over NIXL; `spec` keys replace the defaults'."""
    env = [{"name": k, "value": v} for k, v in ENGINE_ENV.items()]
    return {"engine": "vllm", "engineArgs": ENGINE_ARGS,
            "model": {"servedName": served_name, "source": {"path": model_dir}, "dtype": "float32",
                      "maxModelLen": 512},
            "kvTransfer": {"connector": "NixlConnector", "leaseSeconds": 60},
            "prefill": {"replicas": 1, "env": env}, "decode": {"replicas": 1, "env": env},
            # a starved 2-core machine stalls a proxy's or router's event loop past the default 5 s connect
            # bound (a connection to a vLLM on the same host timed out, CI): the tests are not about that bound
            "router": {"policy": "least-loaded", "timeouts": {"connectSeconds": 60}}, **spec}
