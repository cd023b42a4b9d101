"""The router's HTTP app: the OpenAI routes run the P/D hops (hops.py) after the body is read and checked, the
rest (health, readiness, membership, metrics, models, tokenize) are answered here or by the first ready worker."""
from __future__ import annotations

import json
import uuid
from collections.abc import Awaitable
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from disagg.worker.client_disconnect import unless_disconnected
from disagg.worker.router.capacity import DEFAULT_RETRY_AFTER_S, room_for
from disagg.worker.router.draining import STOPPING_MESSAGE
from disagg.worker.router.hop_bodies import GENERATION_PATHS, check_max_tokens
from disagg.worker.router.hops import serve
from disagg.worker.router.metrics import CONTENT_TYPE_LATEST
from disagg.worker.router.parser_door import over_bound, request_id
from disagg.worker.router.replies import Reply, error_reply, shed_reply
from disagg.worker.router.state import RouterState
from disagg.worker.router.timeouts import Deadline


def build_app(state: RouterState) -> FastAPI:
    app = FastAPI(title="disagg router", docs_url=None, redoc_url=None)
    add_status_routes(app, state)

    @app.get("/v1/models")
    async def models() -> Response:
        for ep in state.decode.available() + state.prefill.available():
            try:
                r = await state.client.get(f"{ep.url}/v1/models", timeout=5.0)
            except httpx.HTTPError:
                continue
            return Response(r.content, status_code=r.status_code, media_type="application/json")
        return to_response(error_reply(503, "no worker endpoint is ready", "service_unavailable"))

    @app.get("/version")
    async def version() -> Response:
        return await _forward(state, "GET", "/version", None)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        return await _forward(state, "POST", "/tokenize", await request.body())

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        return await _forward(state, "POST", "/detokenize", await request.body())

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return to_response(await route(state, request, "/v1/completions"))

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return to_response(await route(state, request, "/v1/chat/completions"))

    app.add_middleware(RefuseAtTheDoor, state=state)
    return app


class RefuseAtTheDoor:
    """ASGI middleware: a generation request that finds the decode pool full - every endpoint saturated, or the
    requests in flight filling what the endpoints held at their last 429 (capacity.room_for) - and no room
    within the queue wait gets its 429 before its body is parsed, and before the framework routes it: under a
    flood nearly every request is refused, and each refusal is then little more than the cost of reading it (as
    at the gateway: the picker's admit). Plain ASGI, inside the API-key check and the body limit: the router's
    CLI adds the limit outside this, so a refused body has been read (not parsed) by then. Putting the door
    outside the limit, to leave refused bodies unread, served less under a flood (bench/overload.py at 10x:
    27-48 against 41-56 req/s, four alternating pairs), so it stays here. With no decode endpoint available the
    request goes on (the hold queue, or the ready wait, answers for it). The same 429 for a request that finds
    the router serving as many as its bound (RouterState.in_flight_bound, --max-in-flight-per-endpoint) - before
    any worker has said it is full, say, when a flood starts (served over httptools, uvicorn's protocol answers
    that one first: parser_door.py)."""

    def __init__(self, app: Any, state: RouterState):
        self.app, self.state = app, state

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        state = self.state
        if scope["type"] != "http" or scope["path"] not in GENERATION_PATHS or scope["method"] != "POST" \
                or not state.decode.available() or state.drain.draining:
            return await self.app(scope, receive, send)
        if (shed := over_bound(state, scope)) is not None:  # (served with httptools: parser_door answers it)
            state.metrics.request("shed")
        else:
            shed = await room_for(state, state.decode, Deadline(state.timeouts))
        if shed is None:
            state.in_flight += 1
            try:
                return await self.app(scope, receive, send)
            finally:
                state.in_flight -= 1
        # the same 429 the route would answer (a plain Response sends without reading the body)
        await to_response(shed_reply(shed, {"X-Request-Id": request_id(scope)}))(scope, receive, send)


def add_status_routes(app: FastAPI, state: RouterState) -> None:
    """/health, /ready (a decode endpoint is ready), /endpoints (membership and what the policy weighs) and
    /metrics: the router's, and the endpoint picker's on its HTTP port."""

    @app.get("/health")
    async def health() -> Response:
        """503 while a background task is down (supervision.py), naming it and why."""
        if state.down:
            return JSONResponse({"status": "unhealthy", "down": dict(state.down)}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/ready")
    async def ready() -> Response:
        """Ready when a decode endpoint is; or always while requests are held (hold.py): with the pools at
        zero this router must stay in its Service, or the request that brings them back could not reach it."""
        n_decode, n_prefill = len(state.decode.available()), len(state.prefill.available())
        ready = (n_decode > 0 or state.hold is not None) and not state.drain.draining
        body = {"ready": ready, "decode_ready": n_decode, "prefill_ready": n_prefill}
        if state.drain.draining:
            body["reason"] = "draining"
        return JSONResponse(body, status_code=200 if ready else 503)

    @app.get("/endpoints")
    async def endpoints() -> Response:
        """The current membership (who scales workers waits here until a removed one is gone) and what the
        policy weighs: load (requests in flight from here, or running + waiting by the worker's last /metrics)
        and KV cache usage. Round-robin scrapes no /metrics: its load is this router's requests in flight and
        its KV usage is null (unknown), not 0."""
        body = {pool.role: [{"url": e.url, "ready": e.ready, "outstanding": e.outstanding, "load": e.load(),
                             "kv_usage": e.kv_usage if pool.scrapes_metrics else None, "ejected": e in pool.ejected(),
                             "ejections": e.health.ejections}
                            for e in pool.endpoints.values()] for pool in (state.prefill, state.decode)}
        return JSONResponse(body)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)


def to_response(reply: Reply) -> Response:
    if reply.stream is not None:
        return StreamingResponse(reply.stream, status_code=reply.status, media_type="text/event-stream",
                                 headers=reply.headers)
    return Response(reply.content, status_code=reply.status, media_type="application/json", headers=reply.headers)


async def _forward(state: RouterState, method: str, path: str, content: bytes | None) -> Response:
    """A stateless call (tokenize, version) answered by the first ready worker that answers."""
    for ep in state.decode.available() + state.prefill.available():
        try:
            r = await state.client.request(method, f"{ep.url}{path}", content=content, timeout=10.0,
                                           headers={"Content-Type": "application/json"})
        except httpx.HTTPError:
            continue
        return Response(r.content, status_code=r.status_code, media_type="application/json")
    return to_response(error_reply(503, "no worker endpoint is ready", "service_unavailable"))


async def route(state: RouterState, request: Request, path: str) -> Reply:
    """Read and check the client's body (a 400 naming what is wrong), then plan and run the hops."""
    try:
        body = json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        state.metrics.request("bad_request")
        return error_reply(400, f"malformed JSON body: {e}", "invalid_request_error")
    if not isinstance(body, dict):
        state.metrics.request("bad_request")
        return error_reply(400, "request body must be a JSON object", "invalid_request_error")
    problem = check_max_tokens(body)
    if problem:
        state.metrics.request("bad_request")
        return error_reply(400, problem, "invalid_request_error", problem.split(" ", 1)[0])
    headers = {"X-Request-Id": request.headers.get("x-request-id") or uuid.uuid4().hex}

    async def hops() -> Reply:
        # with no decode ready (pools at zero, say) the request waits in the hold queue (hold.py), if it is on
        held = await state.hold.wait_for(state.decode) if state.hold is not None else None
        if held is not None and not isinstance(held, float):  # the hold queue is full or the hold ran out
            state.metrics.request(f"hold_{held.reason}")
            return state.hold.refusal_reply(held)
        deadline = Deadline(state.timeouts)  # the hops' bounds start after the hold
        if (shed := await room_for(state, state.decode, deadline)) is not None:  # before any work for it
            return shed_reply(shed, headers)
        reply = await serve(state, await state.plan(body, path), path, body, headers, deadline)
        return reply if held is None else state.hold.timed(reply, held, state.metrics.cold_started)

    return await answered(state, request, hops())


async def answered(state: RouterState, request: Request, work: Awaitable[Reply]) -> Reply:
    """The reply `work` gives, unless the client leaves first - then the work is cancelled: its hop's connection
    closes and the worker aborts the request (a streamed reply's framework does the same once it streams) - or
    the drain timeout runs out first (a 503)."""
    came, outcome = await unless_disconnected(request, state.drain.unless_stopping(work))
    if not came:
        state.metrics.request("client_gone")
        return Reply(499)
    finished, reply = outcome
    if not finished:
        state.metrics.request("unavailable")
        stopping = error_reply(503, STOPPING_MESSAGE, "service_unavailable")
        stopping.headers = {"Retry-After": str(DEFAULT_RETRY_AFTER_S)}
        return stopping
    return reply
