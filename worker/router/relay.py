"""The decode stream's relay to the client, once its first byte has come: every chunk passed on as it arrives,
each wait bounded (idle, total). The 200 is sent by then, so a failure ends the stream with an SSE error event,
counted, and an endpoint that broke it or fell silent is marked failed (outliers.py)."""
from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx

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


async def relay(state: RouterState, stream: DecodeStream, deadline: Deadline) -> AsyncIterator[bytes]:
    ep, resp, chunks, start = stream.ep, stream.resp, stream.chunks, stream.start
    cause = None
    try:
        yield stream.first
        while True:
            try:
                chunk = await within(chunks.__anext__(), deadline, "idle")
            except StopAsyncIteration:
                break
            yield chunk
    except HopTimeout as e:  # silent too long (hung worker), or the request's total ran out
        cause = e.stage
        logger.warning("decode stream from %s timed out: %s", ep.url, e)
        state.metrics.timed_out("decode", e.stage)
        if e.stage == "idle":  # the total running out says nothing about the endpoint
            state.tell_ejection("decode", ep, state.decode.mark_failed(ep, timed_out=True))
        yield sse_error(f"decode worker {ep.url} timed out mid-stream: {e}", 504, "timeout")
    except httpx.HTTPError as e:  # the decode worker went away mid-stream: end the stream cleanly
        cause = "error"
        logger.warning("decode stream from %s broke: %s: %s", ep.url, type(e).__name__, e)
        state.tell_ejection("decode", ep, state.decode.mark_failed(ep))
        yield sse_error(f"decode worker {ep.url} failed mid-stream: {type(e).__name__}")
    finally:
        ep.outstanding -= 1
        state.metrics.hop("decode", time.monotonic() - start, error=cause is not None)
        state.metrics.request("upstream_error" if cause == "error" else "timeout" if cause else "ok")
        if cause is not None:
            state.metrics.stream_broken(cause)
        await resp.aclose()
