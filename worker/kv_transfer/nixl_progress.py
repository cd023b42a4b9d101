"""The thread that drives a NIXL agent, so posting and progressing transfers never runs inside an engine step.

On CPU a READ's bytes move inside nixl's transfer() call (UCX copies them with CMA before it returns, about
3 ms for 2k tokens of a small model), and without NIXL's own progress thread (it burns a core even when idle)
progress happens only inside our calls. Run in the engine thread, both stall every other request's next
token. This thread owns the agent instead: the engine thread hands it work through a queue and picks up
results under a lock (nixl_worker.py), and the thread calls `progress()` at the interval it returns.

    thread = ProgressThread(progress, name="nixl-progress")   # progress() -> seconds until the next call
    thread.start(); thread.wake()  # new work: call progress() now
    thread.stop()                  # joins; progress() is not called afterwards
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable

logger = logging.getLogger(__name__)


class ProgressThread:
    def __init__(self, progress: Callable[[], float], name: str):
        self._progress = progress
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.error: BaseException | None = None  # what ended the thread early, if anything

    def start(self) -> None:
        self._thread.start()

    def wake(self) -> None:
        self._wake.set()

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        while not self._stopping.is_set():
            try:
                interval = self._progress()
            except Exception as e:  # noqa: BLE001 - the owner sees it through .error and fails its transfers
                logger.exception("NIXL progress thread died")
                self.error = e
                return
            self._wake.wait(interval)
            self._wake.clear()
