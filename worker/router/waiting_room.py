"""The requests waiting for room at a pool whose every endpoint is saturated (capacity.py), with its bounds."""
from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field

DEFAULT_QUEUE_WAIT_S = 0.5  # a short wait: what a client waits more than that for is better told to come back
DEFAULT_MAX_QUEUED = 1000


@dataclass
class WaitingRoom:
    """The requests waiting for room in one pool, woken in arrival order."""
    queue_wait_s: float = DEFAULT_QUEUE_WAIT_S
    max_queued: int = DEFAULT_MAX_QUEUED
    _waiters: deque = field(default_factory=deque)  # of asyncio.Future, oldest first

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def notify(self, n: int = 1) -> None:
        """Room for n requests: wake the first n waiters (each picks again)."""
        while n > 0 and self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                n -= 1

    def notify_all(self) -> None:
        self.notify(len(self._waiters))

    async def wait(self, timeout_s: float) -> None:
        """Until notified or `timeout_s` passed."""
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await asyncio.wait_for(waiter, timeout_s)
        except TimeoutError:
            pass
        finally:
            if waiter in self._waiters:
                self._waiters.remove(waiter)
