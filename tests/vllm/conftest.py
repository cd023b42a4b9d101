"""The vLLM tier: tests that run vLLM's CPU build for real. They find it through DISAGG_VLLM (the `vllm`
launcher that .ci/install-vllm.sh writes and prints) and are skipped, saying so, when it is not set."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import waiting

from vllm_env import ALONE_ENV, ENGINE_ARGS, KINDS, MODEL, STARTUP_S, generate
from vllm_fleet import SKIP_REASON, VLLM_ENV, write_vllm_checkpoint

from disagg.worker.local.process import LocalProcess, ProcessSpec, free_port, is_ready


def pytest_collection_modifyitems(items):
    here = Path(__file__).parent
    for item in items:
        if Path(str(item.fspath)).is_relative_to(here):
            item.add_marker(pytest.mark.slow)
            item.add_marker(pytest.mark.timeout(1500))  # vLLM starts in ~1 min alone, several on a busy machine
            if not os.environ.get(VLLM_ENV):
                item.add_marker(pytest.mark.skip(reason=SKIP_REASON))


@pytest.fixture(scope="session")
def vllm_executable() -> str:
    path = shutil.which(os.environ.get(VLLM_ENV, ""))
    assert path, f"{VLLM_ENV}={os.environ.get(VLLM_ENV)!r} is not an executable"
    return path


@pytest.fixture(scope="session")
def vllm_model_dir(tmp_path_factory) -> str:
    return write_vllm_checkpoint(tmp_path_factory.mktemp("vllm-tiny"))


@pytest.fixture(scope="session")
def reference_texts(vllm_executable, vllm_model_dir, tmp_path_factory) -> dict[str, str]:
    """One colocated `vllm serve` (no KV connector): the greedy texts P/D must reproduce."""
    port = free_port()
    argv = [vllm_executable, "serve", vllm_model_dir, "--served-model-name", MODEL, "--host", "127.0.0.1",
            "--port", str(port), "--dtype", "float32", "--max-model-len", "512", *ENGINE_ARGS]
    proc = LocalProcess(ProcessSpec("reference", argv, f"http://127.0.0.1:{port}", dict(ALONE_ENV)),
                        tmp_path_factory.mktemp("vllm-ref"))
    proc.start()
    try:
        waiting.wait_for(lambda: is_ready(proc.spec.url) or proc.exited() is not None, STARTUP_S, "the reference vLLM",
                         interval=0.5)
        assert proc.exited() is None, proc.log_tail(40)
        return {kind: generate(proc.spec.url, kind, False) for kind in KINDS}
    finally:
        proc.terminate()
        proc.popen.wait(60)
