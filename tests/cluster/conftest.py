"""The cluster-in-one-box tier: one cluster (API server, Deployment controller, kubelet, operator) per test module
(started in ~2 s; gone before the next tier runs, so nothing of it outlives the tier); each scenario applies a
CR of its own and deletes it. On a failure the pods' logs are printed. Needs root (each pod runs in a mount
namespace of its own); skipped otherwise."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

OPERATOR_TESTS = Path(__file__).resolve().parents[1] / "integration" / "operator"
if str(OPERATOR_TESTS) not in sys.path:  # the emulator and the operator harness
    sys.path.insert(0, str(OPERATOR_TESTS))

from cluster import NODE_PARENT, Cluster  # noqa: E402


def _mount_namespaces_work() -> bool:
    if os.geteuid() != 0:
        return False
    try:
        return subprocess.run(["unshare", "--mount", "--", "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    outcome = yield
    setattr(item, f"rep_{call.when}", outcome.get_result())


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    if not _mount_namespaces_work():
        pytest.skip("the cluster tier needs root and `unshare --mount` (pods run in mount namespaces)")
    c = Cluster(tmp_path_factory.mktemp("cluster-logs")).start()
    try:
        yield c
    finally:
        pids = [pid for pids in (c.kubelet.pids() if c.kubelet else {}).values() for pid in pids]
        c.stop()
        left = [pid for pid in pids if _alive(pid)]
        assert not left, f"pod processes still running after the cluster stopped: {left}"


@pytest.fixture(autouse=True)
def print_pod_logs_on_failure(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    report = getattr(request.node, "rep_call", None)
    if report is not None and report.failed and "cluster" in request.fixturenames:
        print(request.getfixturevalue("cluster").logs())


@pytest.fixture(scope="session")
def checkpoint() -> Iterator[str]:
    """The tiny generated checkpoint "inside the image": a host directory outside /tmp, which pods replace."""
    from disagg.worker.model import write_tiny_checkpoint

    image = Path(tempfile.mkdtemp(prefix="cluster-image-", dir=NODE_PARENT))
    try:
        yield str(write_tiny_checkpoint(image / "tiny-llama"))
    finally:
        shutil.rmtree(image, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is not running
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False

