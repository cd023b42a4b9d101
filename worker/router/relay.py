"""The decode stream's relay to the client, once its first byte has come: every chunk passed on as it arrives,
each wait bounded (idle, total). The 200 is sent by then, so a failure ends the stream with an SSE error event,
counted, and an endpoint that broke it or fell silent is marked failed (outliers.py). A stream still open when
the router's drain timeout runs out (draining.py) ends with an SSE error event (503) too, and says nothing
about its worker. A client that leaves closes the stream (its worker aborts the request): counted client_gone,
no verdict on the worker."""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx

from disagg.worker.router.capacity import released
from disagg.worker.router.draining import STOPPING_MESSAGE
from disagg.worker.router.endpoints import Endpoint
from disagg.worker.router.replies import sse_error
from disagg.worker.router.state import RouterState
from disagg.worker.router.timeouts import Deadline, HopTimeout, within

logger = logging.getLogger(__name__)


@dataclass
class DecodeStream:
    """A decode endpoint's stream that has its first byte."""
    ep: Endpoint
    resp: httpx.Response
    first: bytes  # the first bytes read
    chunks: AsyncIterator[bytes]  # the rest
    start: float  # when the hop was sent (monotonic)
    cut: bool = False  # the router's drain timeout ran out: its response was closed (draining.py)

    __hash__ = object.__hash__  # one of a set (the open streams) by identity


async def relay(state: RouterState, stream: DecodeStream, deadline: Deadline) -> AsyncIterator[bytes]:
    ep, resp, chunks, start = stream.ep, stream.resp, stream.chunks, stream.start
    cause = None
    state.drain.streams.add(stream)
    try:
        yield stream.first
        while True:
            try:
                chunk = await within(chunks.__anext__(), deadline, "idle")
            except StopAsyncIteration:
                break
            ep.answered()
            yield chunk
    except HopTimeout as e:  # silent too long (hung worker), or the request's total ran out
        cause = e.stage
        logger.warning("decode stream from %s timed out: %s", ep.url, e)
        state.metrics.timed_out("decode", e.stage)
        if e.stage == "idle":  # the total running out says nothing about the endpoint
            state.tell_ejection("decode", ep, state.decode.mark_failed(ep, timed_out=True))
        yield sse_error(f"decode worker {ep.url} timed out mid-stream: {e}", 504, "timeout")
    except (asyncio.CancelledError, GeneratorExit):  # the client left: its stream is closed, its worker aborts
        cause = "client_gone"
        raise
    except httpx.HTTPError as e:
        if stream.cut:  # the router's drain timeout ran out (its own doing: no verdict on the worker)
            cause = "drain"
            yield sse_error(STOPPING_MESSAGE, 503, "service_unavailable")
            return
        # the decode worker went away mid-stream: end the stream cleanly
        cause = "error"
        logger.warning("decode stream from %s broke: %s: %s", ep.url, type(e).__name__, e)
        state.tell_ejection("decode", ep, state.decode.mark_failed(ep))
        yield sse_error(f"decode worker {ep.url} failed mid-stream: {type(e).__name__}")
    finally:
        state.drain.streams.discard(stream)
        released(state, state.decode, ep)
        state.metrics.hop("decode", time.monotonic() - start, error=cause not in (None, "drain", "client_gone"))
        outcome = {None: "ok", "error": "upstream_error", "drain": "unavailable",
                   "client_gone": "client_gone"}.get(cause, "timeout")
        state.metrics.request(outcome)
        if cause not in (None, "client_gone"):  # a stream the router or its worker broke
            state.metrics.stream_broken(cause)
        await resp.aclose()
