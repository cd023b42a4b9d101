"""The operator tests' harness: the CR's resource, the operator (kopf) in its own thread, quiesce(). Imported by the
fixtures in conftest.py, by the tests here and by the install tests (a module name of its own: `conftest` is
ambiguous when several test directories run together)."""
from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

from emulator import EmulatorThread

CR = ("disagg.dev", "v1alpha1", "disaggregatedinferences")  # (group, version, plural)
RESYNC_SECONDS = 0.3
EXAMPLES = Path(__file__).resolve().parents[3] / "examples"


class OperatorThread:
    """kopf.operator() in a daemon thread with its own loop; stop() returns in well under a second."""

    def __init__(self, resync_seconds: float = RESYNC_SECONDS, memo: dict | None = None):
        """memo: more of the operator's injected parts (handlers.configure), e.g. api_backoffs."""
        from disagg.operator.autoscaling.cluster import OperatorMetrics
        from disagg.operator.handlers import build_registry
        self.registry = build_registry(resync_seconds)
        self.metrics = OperatorMetrics()  # the operator's Prometheus registry, for tests to read
        self.ready = threading.Event()
        self.stopping = threading.Event()
        self.thread: threading.Thread | None = None
        self.memo = memo or {}
        self.error: BaseException | None = None

    def start(self) -> OperatorThread:
        import kopf

        def main() -> None:
            loop = asyncio.new_event_loop()
            asyncio.set_event_loop(loop)
            try:
                loop.run_until_complete(kopf.operator(
                    registry=self.registry, standalone=True, clusterwide=True,
                    memo=kopf.Memo(metrics=self.metrics, **self.memo), ready_flag=self.ready, stop_flag=self.stopping))
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


def quiesce(api: EmulatorThread, window: float = 0.4, timeout: float = 2.0) -> None:
    """Best effort: stop the operator between writes. A watch event that lands while kopf exits can respawn
    a timer after kopf's daemon killer ran; kopf then waits 5 s for that hung task."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        start = len(api.emulator.requests)
        time.sleep(window)
        if not api.emulator.writes(start):
            return
