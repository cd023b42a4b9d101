"""Holding requests that find no ready decode endpoint (a pool scaled to zero, or starting): instead of a 503 at
once, a request waits in a bounded queue - at most `seconds` each, at most `max_requests` at a time - and goes on
the moment one decode endpoint is ready (decode alone until a prefill endpoint is ready too: the hops fall back
by themselves). Beyond either bound the client gets a clear refusal with Retry-After: 429 when the queue is full,
503 when the hold ran out.

The held count is exported (disagg:router_held_requests): it is the autoscaler's signal to bring pools back from
zero, where no worker exists to export load. The cold start (held -> the client's first byte) is a histogram.

Framework-free: the router's app and the gateway's endpoint picker each turn a `Refusal` into their own answer.
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from disagg.worker.router.endpoints import EndpointPool
from disagg.worker.router.replies import Reply, error_reply

logger = logging.getLogger(__name__)

POLL_S = 0.05  # how often a held request looks at the decode pool (membership and probes change it)
PROBE_EVERY_S = 0.25  # how often the not-ready decode endpoints are probed while requests are held
MAX_RETRY_AFTER_S = 30


@dataclass(frozen=True)
class HoldSettings:
    seconds: float = 0.0  # the longest one request is held; 0: no hold (a 503 once the connect bound is waited)
    max_requests: int = 100  # requests held at once; one more is refused with 429

    @property
    def enabled(self) -> bool:
        return self.seconds > 0

    def problems(self) -> list[str]:
        out = []
        if self.seconds < 0:
            out.append(f"--hold-seconds must be >= 0, got {self.seconds}")
        if self.max_requests < 1:
            out.append(f"--max-held-requests must be >= 1, got {self.max_requests}")
        return out

    @property
    def retry_after_s(self) -> int:
        """What a refused client is told to wait: about as long as a hold lasts (the pools are coming back)."""
        return max(1, min(MAX_RETRY_AFTER_S, math.ceil(self.seconds)))


@dataclass(frozen=True)
class Refusal:
    status: int  # 429: the queue is full; 503: the hold ran out
    reason: str  # "full" | "timeout" (the outcome label of disagg:router_requests: hold_full, hold_timeout)
    message: str
    retry_after_s: int


class HoldQueue:
    """The held requests of one routing program. `probe`: probes the not-ready endpoints of a pool now (so a
    starting worker is taken as soon as it is ready, not at the next probe round)."""

    def __init__(self, settings: HoldSettings, probe: Callable[[EndpointPool], Awaitable[None]] | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.settings = settings
        self.probe = probe
        self.clock = clock
        self.held = 0  # requests waiting now

    async def wait_for(self, pool: EndpointPool) -> Refusal | float | None:
        """None: an endpoint of `pool` is ready, or holding is off (nothing waited). A float: the request was held
        from then (clock) until one became ready. A Refusal: the queue was full, or the hold ran out."""
        if pool.available() or not self.settings.enabled:
            return None
        s = self.settings
        if self.held >= s.max_requests:
            return Refusal(429, "full", f"{self.held} requests are already held waiting for a {pool.role} worker "
                           f"to start (at most {s.max_requests}); retry later", s.retry_after_s)
        since = self.clock()
        self.held += 1
        if self.held == 1:
            logger.info("no %s endpoint ready (%d known): holding requests up to %g s", pool.role,
                        len(pool.endpoints), s.seconds)
        try:
            next_probe = since
            while not pool.available():
                now = self.clock()
                if now - since >= s.seconds:
                    return Refusal(503, "timeout", f"no {pool.role} worker became ready within the {s.seconds:g} s "
                                   f"this request was held ({len(pool.endpoints)} known); retry later",
                                   s.retry_after_s)
                if self.probe is not None and now >= next_probe:
                    next_probe = now + PROBE_EVERY_S
                    await self.probe(pool)
                    continue
                await asyncio.sleep(POLL_S)
        finally:
            self.held -= 1
        logger.info("%s endpoint ready after %.2f s: a held request goes on", pool.role, self.clock() - since)
        return since

    def refusal_reply(self, refusal: Refusal) -> Reply:
        reply = error_reply(refusal.status, refusal.message,
                            "rate_limit_exceeded" if refusal.status == 429 else "service_unavailable")
        reply.headers = {"Retry-After": str(refusal.retry_after_s)}
        return reply

    def timed(self, reply: Reply, since: float, observe: Callable[[float], None]) -> Reply:
        """The reply of a request held from `since`, telling `observe` the cold start (seconds from being held to
        the client's first byte: a stream's first chunk, or the whole answer)."""
        if reply.stream is None:
            observe(self.clock() - since)
            return reply
        reply.stream = _on_first_chunk(reply.stream, lambda: observe(self.clock() - since))
        return reply


async def _on_first_chunk(stream: AsyncIterator[bytes], first: Callable[[], None]) -> AsyncIterator[bytes]:
    told = False
    try:
        async for chunk in stream:
            if not told:
                first()
                told = True
            yield chunk
    finally:  # a client that went away closes this wrapper: the relay's own cleanup must still run
        aclose = getattr(stream, "aclose", None)
        if aclose is not None:
            await aclose()
