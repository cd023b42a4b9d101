import sys
from pathlib import Path

import pytest

# test-support modules shared across tiers (helm_cli, k8s_patch) live in tests/ itself
sys.path.insert(0, str(Path(__file__).resolve().parent))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """The embedded-default tiny checkpoint (random weights, real tokenizer), written once."""
    from disagg.worker.model import write_tiny_checkpoint

    return str(write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama")))
