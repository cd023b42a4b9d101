"""What a routed request answers the client, independent of the HTTP framework that sends it: a whole JSON answer
or an SSE stream, and an error in either form (OpenAI's error body)."""
from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from disagg.worker.server.protocol import error_body, sse


@dataclass
class Reply:
    status: int
    content: bytes = b""  # the whole answer (JSON), when not streamed
    stream: AsyncIterator[bytes] | None = None  # the SSE stream (status 200 sent with its first chunk)
    headers: dict[str, str] | None = None


def error_reply(status: int, message: str, type_: str, param: str | None = None) -> Reply:
    body = error_body(status, message, type_, param)
    return Reply(status, json.dumps(body, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode())


def sse_error(message: str, status: int = 502, type_: str = "upstream_error") -> bytes:
    return sse(error_body(status, message, type_)) + sse("[DONE]")


def as_sse_error(reply: Reply) -> bytes:
    """A JSON error answer as the event that ends a stream already started."""
    try:
        err = json.loads(reply.content)["error"]
        return sse_error(err["message"], reply.status, err.get("type") or "upstream_error")
    except (ValueError, KeyError, TypeError):
        return sse_error(reply.content.decode(errors="replace")[:500] or f"HTTP {reply.status}", reply.status)


def shed_reply(shed: Any, headers: dict[str, str] | None) -> Reply:
    """Every worker of a pool is at capacity (router/capacity.Shed): 429 with Retry-After."""
    reply = error_reply(429, shed.message, "rate_limit_exceeded")
    reply.headers = {**(headers or {}), "Retry-After": str(shed.retry_after_s)}
    return reply


BUSY_RETRY_AFTER_S = 1


def busy_reply(state: Any, headers: dict[str, str] | None) -> Reply:
    """The router's connection pool to the workers is full (httpx.PoolTimeout): a 503 with Retry-After, and no
    verdict on any worker."""
    state.metrics.request("busy")
    reply = error_reply(503, "the router's connections to its workers are all in use; retry later",
                        "service_unavailable")
    reply.headers = {**(headers or {}), "Retry-After": str(BUSY_RETRY_AFTER_S)}
    return reply
