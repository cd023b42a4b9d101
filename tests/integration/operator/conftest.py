"""Fixtures: an emulated API server over real HTTP on 127.0.0.1 and the operator (kopf) in its own thread."""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import yaml

from emulator import EmulatorThread, Kind

from disagg.operator import spec as s

T = TypeVar("T")
CR = ("disagg.dev", "v1alpha1", "disaggregatedinferences")
RESYNC_SECONDS = 0.3
EXAMPLES = Path(__file__).resolve().parents[3] / "examples"


def wait_for(probe: Callable[[], T], timeout: float = 30.0, what: str = "condition") -> T:
    """Poll until probe() returns something truthy; fail with the last value after the deadline."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = probe()
        if last:
            return last
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last value: {last!r}")


class OperatorThread:
    """kopf.operator() in a daemon thread with its own loop; stop() returns in well under a second."""

    def __init__(self, resync_seconds: float = RESYNC_SECONDS):
        from disagg.operator.autoscaler import OperatorMetrics
        from disagg.operator.handlers import build_registry
        self.registry = build_registry(resync_seconds)
        self.metrics = OperatorMetrics()  # the operator's Prometheus registry, for tests to read
        self.ready = threading.Event()
        self.stopping = threading.Event()
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def start(self) -> OperatorThread:
        import kopf

        def main() -> None:
            loop = asyncio.new_event_loop()
            asyncio.set_event_loop(loop)
            try:
                loop.run_until_complete(kopf.operator(
                    registry=self.registry, standalone=True, clusterwide=True, memo=kopf.Memo(metrics=self.metrics),
                    ready_flag=self.ready, stop_flag=self.stopping))
            except BaseException as e:  # surfaced by stop()
                self.error = e
            finally:
                loop.close()

        self.thread = threading.Thread(target=main, name="operator", daemon=True)
        self.thread.start()
        if not self.ready.wait(15):
            raise RuntimeError(f"operator did not become ready: {self.error!r}")
        return self

    def stop(self) -> None:
        self.stopping.set()
        if self.thread is not None:
            self.thread.join(15)
            assert not self.thread.is_alive(), "operator thread did not stop"


@pytest.fixture
def cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[EmulatorThread]:
    with EmulatorThread() as api:
        api.emulator.declare(*CR, Kind(s.KIND, status_subresource=True, short_names=tuple(s.SHORT_NAMES)))
        with api.client() as http:  # kopf watching named namespaces looks them up
            http.post("/api/v1/namespaces", json={"metadata": {"name": "default"}}).raise_for_status()
        kubeconfig = tmp_path / "kubeconfig.yaml"
        kubeconfig.write_text(yaml.safe_dump(api.kubeconfig()))
        monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
        monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
        yield api


@pytest.fixture
def operator(cluster: EmulatorThread) -> Iterator[OperatorThread]:
    logging.getLogger("kopf").setLevel(logging.WARNING)
    op = OperatorThread().start()
    yield op
    quiesce(cluster)
    op.stop()


def quiesce(api: EmulatorThread, window: float = 0.4, timeout: float = 2.0) -> None:
    """Best effort: stop the operator between writes. A watch event that lands while kopf exits can respawn
    a timer after kopf's daemon killer ran; kopf then waits 5 s for that hung task."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        start = len(api.emulator.requests)
        time.sleep(window)
        if not api.emulator.writes(start):
            return


@pytest.fixture
def example() -> dict[str, Any]:
    return yaml.safe_load((EXAMPLES / "llama3-8b-gpu.yaml").read_text())
