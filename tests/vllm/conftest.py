"""The vLLM tier: tests that run vLLM's CPU build for real. They find it through DISAGG_VLLM (the `vllm`
launcher that .ci/install-vllm.sh writes and prints) and are skipped, saying so, when it is not set."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from vllm_fleet import SKIP_REASON, VLLM_ENV, write_vllm_checkpoint


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
