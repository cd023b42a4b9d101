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


def pytest_collection_modifyitems(config, items):
    """Multi-process cases (marked slow: real servers, vLLM, the emulated cluster) run once more after a failure
    (pytest-rerunfailures; the run's summary counts each rerun). On a shared 2-core machine a case can lose a
    deadline to the machine, not the code - CI stops have failed on cases that passed alone; a real bug fails
    twice. In-process tests get no second try."""
    if not config.pluginmanager.hasplugin("rerunfailures"):
        return
    for item in items:
        if item.get_closest_marker("slow") and not item.get_closest_marker("flaky"):
            item.add_marker(pytest.mark.flaky(reruns=1, reruns_delay=5))
