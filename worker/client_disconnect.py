"""A client that leaves cancels its request: `unless_disconnected` waits for an answer or for the client's
disconnect, whichever comes first, and cancels the wait on the answer when the client went (a router's hop then
closes its connection to the worker, whose own wait sees that disconnect and aborts the request in its engine).
For the HTTP programs that answer one whole response (a streamed one is cancelled by its framework when a write
fails or the client disconnects)."""
from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import Any, TypeVar

T = TypeVar("T")


async def unless_disconnected(request: Any, awaitable: Awaitable[T]) -> tuple[bool, T | None]:
    """(True, the answer), or (False, None) when the client disconnected first (the awaitable is cancelled).
    `request`: a Starlette request whose body was read (its next message is the disconnect)."""
    return await unless(awaitable, _wait_disconnect(request))


async def unless(awaitable: Awaitable[T], stop: Awaitable[Any]) -> tuple[bool, T | None]:
    """(True, the awaitable's result), or (False, None) when `stop` completed first: the awaitable is cancelled,
    and its cleanup (closing a hop's connection) has run when this returns."""
    task = asyncio.ensure_future(awaitable)
    watch = asyncio.ensure_future(stop)
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watch.cancel()
    if task.done():
        return True, task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
    return False, None


async def _wait_disconnect(request: Any) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
