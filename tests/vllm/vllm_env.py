"""Settings the vLLM tier's tests share."""
from __future__ import annotations

import os

VLLM_ENV = "DISAGG_VLLM"  # the `vllm` executable (the launcher .ci/install-vllm.sh writes)
# what vLLM's CPU build needs on a small machine: a bounded KV cache (GiB). `disagg up` gives each vLLM process
# cores of its own (launcher.vllm_cpu_bind); one vLLM alone binds to every core
ENGINE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}
ALONE_ENV = {**ENGINE_ENV, "VLLM_CPU_OMP_THREADS_BIND": f"0-{max(0, (os.cpu_count() or 1) - 1)}"}
