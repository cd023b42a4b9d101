"""Background tasks that must keep running (probes, discovery, KV-event subscriptions, the endpoint picker's):
one that dies - raises, or returns - is logged with its exception, counted
(`disagg:router_task_restarts_total{task}`) and started again after a backoff (0.5 s, doubling to 30 s; back to
0.5 s once a run lasted a minute). While it is down, `down` names it and why, and /health answers 503 with that.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

logger = logging.getLogger(__name__)

FIRST_BACKOFF_S, MAX_BACKOFF_S, HEALTHY_RUN_S = 0.5, 30.0, 60.0


class Supervisor:
    def __init__(self, metrics: Any, down: dict[str, str]):
        self.metrics = metrics  # RouterMetrics (task_restarted)
        self.down = down  # task name -> why it is down (shared with /health)
        self._tasks: list[asyncio.Task] = []

    def start(self, name: str, run: Callable[[], Awaitable[None]]) -> None:
        self._tasks.append(asyncio.ensure_future(self._keep(name, run)))

    async def _keep(self, name: str, run: Callable[[], Awaitable[None]]) -> None:
        backoff = FIRST_BACKOFF_S
        while True:
            started = time.monotonic()
            try:
                await run()
                why, error = "returned", None
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - any death is logged, counted and restarted
                why, error = f"{type(e).__name__}: {e}", e
            if time.monotonic() - started >= HEALTHY_RUN_S:
                backoff = FIRST_BACKOFF_S
            logger.error("background task %s %s; restarting it in %.1f s", name,
                         "died" if error is not None else "returned", backoff, exc_info=error)
            self.down[name] = why
            self.metrics.task_restarted(name)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, MAX_BACKOFF_S)
            self.down.pop(name, None)

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
