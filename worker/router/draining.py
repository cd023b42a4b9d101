"""The router's shutdown, in order (on Kubernetes the pod's preStop sleep comes first, while its endpoints are
taken out of the Service):
1. SIGTERM: /ready answers 503 and requests are still served for `drain_delay_s`, so that whatever still sends
   here (a load balancer or gateway that reads /ready) stops first;
2. the listener closes; requests in flight get `drain_timeout_s` to finish;
3. then every stream still open ends with an SSE error event naming the shutdown (503), and every request still
   waiting for its answer gets a 503 JSON error - never a silent cut - and the process exits.
Standard library only: the operator sizes the router pod's grace period from these defaults.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from disagg.worker.client_disconnect import unless

logger = logging.getLogger(__name__)

DRAIN_DELAY_S = 2.0  # `disagg router --drain-delay`
DRAIN_TIMEOUT_S = 120.0  # `disagg router --drain-timeout`
CUT_GRACE_S = 5.0  # past the drain timeout: the error events go out before the server cancels what is left
STOPPING_MESSAGE = "the router is shutting down: its drain timeout ran out before this request finished"
T = TypeVar("T")


@dataclass
class Drain:
    """One router's shutdown state, shared by its routes and its streams."""
    draining: bool = False  # SIGTERM seen: /ready answers 503
    stop_at: float | None = None  # (monotonic) when open streams are cut, once the listener closed
    streams: set[Any] = field(default_factory=set)  # the decode streams being relayed (relay.DecodeStream)
    _stopping: asyncio.Event | None = None

    @property
    def stopping(self) -> asyncio.Event:
        if self._stopping is None:
            self._stopping = asyncio.Event()
        return self._stopping

    def cut_after(self, seconds: float) -> None:
        """The listener closed: cut what is still open in `seconds` (called once, on the event loop)."""
        if self.stop_at is None:
            self.stop_at = time.monotonic() + seconds
            asyncio.get_running_loop().call_later(seconds, self.cut)

    def cut(self) -> None:
        """The drain timeout ran out: every open stream ends with an error event (relay.py reads `cut`), every
        request still waiting for its answer gets a 503 (`unless_stopping`)."""
        if self.streams:
            logger.warning("drain timeout: ending %d open streams with an error event", len(self.streams))
        self.stopping.set()
        for stream in list(self.streams):
            stream.cut = True
            asyncio.ensure_future(stream.resp.aclose())

    async def unless_stopping(self, awaitable: Awaitable[T]) -> tuple[bool, T | None]:
        """(True, its result), or (False, None) when the drain timeout ran out first (the awaitable is
        cancelled)."""
        return await unless(awaitable, self.stopping.wait())
