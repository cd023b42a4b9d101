"""Bounds on every wait of a routed request: per hop, connecting (connect), the worker's answer (first_byte: the
prefill's reply, a decode stream's first chunk), silence between stream chunks (idle); and the whole client
request (total), which caps each of them. A hung worker (a stopped process, a partition) accepts TCP
connections from its kernel backlog and then says nothing, so the connect bound alone never catches it.

A non-streamed decode answer has no first byte until it is complete, so no first-byte bound fits it. A hung
worker is told apart from a slow one by its readiness probes: once they have timed out in a row for
--unresponsive-after seconds (endpoints.UNRESPONSIVE_AFTER_S), the waits on it that have sent nothing to the
client yet are abandoned (stage "unresponsive") and fail over like a timed-out hop; a worker that answers its
probes, however slowly it generates, is left to finish.
"""
from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Literal, TypeVar

import httpx

Stage = Literal["connect", "first_byte", "idle", "total", "unresponsive"]
STAGES: tuple[Stage, ...] = ("connect", "first_byte", "idle", "total", "unresponsive")
HUNG_POLL_S = 0.1  # how often a wait looks at the worker's probes
T = TypeVar("T")


@dataclass(frozen=True)
class HopTimeouts:
    connect_s: float = 5.0
    first_byte_s: float = 120.0
    idle_s: float = 60.0
    total_s: float = 600.0

    def problems(self) -> list[str]:
        """Each bound must be a positive number of seconds (named by its `disagg router` flag)."""
        return [f"{FLAGS[name]} must be > 0 seconds, got {value}" for name, value in vars(self).items()
                if not value > 0]


FLAGS = {"connect_s": "--connect-timeout", "first_byte_s": "--first-byte-timeout", "idle_s": "--idle-timeout",
         "total_s": "--request-timeout"}


class HopTimeout(Exception):
    """A wait ran past its bound; `stage` names the bound that ended it."""

    def __init__(self, stage: Stage, seconds: float):
        super().__init__(STAGE_WORDS[stage].format(f"{seconds:g}"))
        self.stage, self.seconds = stage, seconds


STAGE_WORDS = {"connect": "no connection within {} s (connect bound)",
               "first_byte": "no first byte within {} s (first-byte bound)",
               "idle": "no stream chunk within {} s (idle bound)",
               "total": "the request's total bound of {} s ran out",
               "unresponsive": "the worker stopped answering its readiness probes (after {} s of this wait)"}


@dataclass
class Deadline:
    """One client request's clock: each wait gets its stage's bound, or what is left of the total if less."""

    timeouts: HopTimeouts
    started: float = field(default_factory=time.monotonic)

    def remaining(self) -> float:
        return self.timeouts.total_s - (time.monotonic() - self.started)

    def bound(self, stage: Stage, since: float | None = None) -> tuple[float, Stage]:
        """(seconds this wait may take, the stage whose bound that is). `since`: when the stage began (a hop's
        first byte is bounded from its start, across the connection, the headers and the first chunk)."""
        limit = {"connect": self.timeouts.connect_s, "first_byte": self.timeouts.first_byte_s,
                 "idle": self.timeouts.idle_s, "total": self.timeouts.total_s}[stage]
        if since is not None:
            limit -= time.monotonic() - since
        left = self.remaining()
        return (max(left, 0.0), "total") if left < limit else (limit, stage)

    def httpx_timeout(self) -> httpx.Timeout:
        """httpx bounds the connection (and pool/write waits); reads are bounded by `within` per stage."""
        seconds, _ = self.bound("connect")
        return httpx.Timeout(connect=max(seconds, 0.001), read=None, write=max(seconds, 0.001),
                             pool=max(seconds, 0.001))


async def within(awaitable: Awaitable[T], deadline: Deadline, stage: Stage, since: float | None = None,
                 hung: Callable[[], bool] | None = None) -> T:
    """Await under the stage's bound (counted from `since` when given); raises HopTimeout naming the bound that
    ended the wait (a connection that could not be made in time is a "connect" timeout). `hung`: the worker's
    probes say it stopped answering - the wait is abandoned then too."""
    seconds, binding = deadline.bound(stage, since)
    full = getattr(deadline.timeouts, f"{binding}_s")  # the configured bound, for the message
    if seconds <= 0:
        if asyncio.iscoroutine(awaitable):
            awaitable.close()  # never awaited: no "coroutine was never awaited" warning
        raise HopTimeout(binding, full)
    started = time.monotonic()
    try:
        async with asyncio.timeout(seconds):
            return await (awaitable if hung is None else _unless_hung(awaitable, hung, started))
    except TimeoutError:
        raise HopTimeout(binding, full) from None
    except httpx.ConnectTimeout:  # httpx bounded it (httpx_timeout): the connection could not be made
        raise HopTimeout("connect", deadline.timeouts.connect_s) from None


async def _unless_hung(awaitable: Awaitable[T], hung: Callable[[], bool], started: float) -> T:
    task = asyncio.ensure_future(awaitable)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=HUNG_POLL_S)
            if done:
                return task.result()
            if hung():
                raise HopTimeout("unresponsive", round(time.monotonic() - started, 1))
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
