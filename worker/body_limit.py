"""A bound on request bodies, for every HTTP program that reads one whole (the worker, the router, pd-proxy): an
ASGI middleware that answers 413 when Content-Length says the body is too large (before reading any of it) or
when the bytes read pass the limit (a chunked body), and 408 when the body stalls - no byte for `idle_s` (a client
that sends headers and never finishes its body holds a socket, never a request's resources). The body it read is
handed to the app as one message; what the client sends after it (its disconnect) is passed on as it comes.
"""
from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

DEFAULT_MAX_BODY_BYTES = 16 * 2**20  # a prompt of max_model_len tokens as text or ids is far below this
BODY_IDLE_TIMEOUT_S = 30.0  # no byte of the body for this long: 408
WITH_BODY = ("POST", "PUT", "PATCH")


def add_body_arguments(p: Any) -> None:
    p.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                   help="larger request bodies are answered 413 (told by Content-Length before reading, else while "
                        "reading)")
    p.add_argument("--request-body-timeout", type=float, default=BODY_IDLE_TIMEOUT_S,
                   help="seconds a request body may send nothing before it is answered 408")


def body_limit_problems(args: Any) -> list[str]:
    """What is wrong with the body flags (each named)."""
    out = []
    if args.max_request_body_bytes < 1:
        out.append(f"--max-request-body-bytes must be >= 1, got {args.max_request_body_bytes}")
    if not args.request_body_timeout > 0:
        out.append(f"--request-body-timeout must be > 0 seconds, got {args.request_body_timeout}")
    return out


class LimitRequestBody:
    """`on_reject(reason)`: counts a refusal (reason body_too_large or body_timeout)."""

    def __init__(self, app: Any, max_bytes: int, idle_s: float = BODY_IDLE_TIMEOUT_S,
                 on_reject: Callable[[str], None] | None = None):
        if max_bytes < 1:
            raise ValueError(f"--max-request-body-bytes must be >= 1, got {max_bytes}")
        self.app, self.max_bytes, self.idle_s, self.on_reject = app, max_bytes, idle_s, on_reject

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] not in WITH_BODY:
            return await self.app(scope, receive, send)
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            return await self._refuse(send, 413, "body_too_large", f"request body of {declared} bytes is over "
                                      f"the limit of {self.max_bytes} bytes")
        chunks, size = [], 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), self.idle_s)
            except TimeoutError:
                return await self._refuse(send, 408, "body_timeout", f"no byte of the request body for "
                                          f"{self.idle_s:g} s")
            if message["type"] == "http.disconnect":
                return  # the client left before its body was complete: nothing to answer
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                return await self._refuse(send, 413, "body_too_large", f"request body is over the limit of "
                                          f"{self.max_bytes} bytes")
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        whole = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replay() -> dict[str, Any]:
            return whole.pop() if whole else await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, send: Any, status: int, reason: str, message: str) -> None:
        if self.on_reject is not None:
            self.on_reject(reason)
        kind = "invalid_request_error" if status == 413 else "timeout"
        body = json.dumps({"error": {"message": message, "type": kind, "param": None, "code": status}}).encode()
        # the rest of the body is not read: the connection is not reused
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


def _content_length(scope: dict[str, Any]) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None
