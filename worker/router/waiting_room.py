"""The requests waiting for room at a pool whose every endpoint is saturated (capacity.py), with its bounds."""
from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field

# A short wait: under a flood every admitted request may spend it before its prefill, so it is TTFT. Measured with
# bench/overload.py (2 cores, capacity 34 req/s): 0.1 s against 0.5 s raised goodput at 2x / 10x capacity from
# 46.8 / 29.4 to 51.6 / 40.3 req/s behind the gateway, and from 27.1 / 12.4 to 35.5 / 16.2 through the router.
DEFAULT_QUEUE_WAIT_S = 0.1
DEFAULT_MAX_QUEUED = 1000
# Generation requests the router serves at once, per ready decode worker (app.RefuseAtTheDoor; and
# routing.IN_FLIGHT_CEILING in all). The router's listener accepts every connection that comes (listener.py), so
# under a flood, before any worker has answered 429, this bound is where the excess is refused - a fast 429 with
# Retry-After instead of a connection left in the kernel's accept queue. This default is `disagg router` run by
# hand; from a spec the router gets what one decode worker takes at once (operator spec.RouterAdmission): on 2
# CPU cores (bench/overload.py, 10x of 77 req/s) that bound, 72, served 30-45 req/s within the SLO, 256 15-37.
DEFAULT_MAX_IN_FLIGHT_PER_ENDPOINT = 256


@dataclass
class WaitingRoom:
    """The requests waiting for room in one pool, woken in arrival order - those whose client has its 200 already
    (committed: the early first token was sent) before the others."""
    queue_wait_s: float = DEFAULT_QUEUE_WAIT_S
    max_queued: int = DEFAULT_MAX_QUEUED
    committed_in_line: int = 0  # committed requests waiting for room here (capacity.py): none other takes it
    _committed: deque = field(default_factory=deque)  # of asyncio.Future, oldest first
    _waiters: deque = field(default_factory=deque)

    @property
    def waiting(self) -> int:
        return len(self._committed) + len(self._waiters)

    def notify(self, n: int = 1) -> None:
        """Room for n requests: wake the first n waiters (each picks again)."""
        for queue in (self._committed, self._waiters):
            while n > 0 and queue:
                waiter = queue.popleft()
                if not waiter.done():
                    waiter.set_result(None)
                    n -= 1

    def notify_all(self) -> None:
        self.notify(self.waiting)

    async def wait(self, timeout_s: float, committed: bool = False) -> None:
        """Until notified or `timeout_s` passed."""
        waiter = asyncio.get_running_loop().create_future()
        queue = self._committed if committed else self._waiters
        queue.append(waiter)
        try:
            await asyncio.wait_for(waiter, timeout_s)
        except TimeoutError:
            pass
        finally:
            if waiter in queue:
                queue.remove(waiter)
