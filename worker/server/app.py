"""The worker's HTTP API: OpenAI-compatible completions and chat (plain and SSE streaming), models,
health, readiness and Prometheus metrics, over one EngineLoop."""
from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from disagg.worker.body_limit import BODY_IDLE_TIMEOUT_S, DEFAULT_MAX_BODY_BYTES, LimitRequestBody
from disagg.worker.server.admission import Preparer, PromptTooLong, QueueFull
from disagg.worker.server.metrics import CONTENT_TYPE_LATEST
from disagg.worker.server.engine_loop import EngineLoop
from disagg.worker.server.generation import Job, complete, observe, stream
from disagg.worker.router.decode_side import PREFILL_HEADER
from disagg.worker.router.hop_bodies import RELEASE_PATH
from disagg.worker.router.hops import release_unread, settle_handoff
from disagg.worker.server.pd_hop import merged_metrics, prefill_remotely
from disagg.worker.client_disconnect import unless_disconnected
from disagg.worker.server.protocol import (
    APIError, CompletionRequest, check_kv_transfer_params, check_signature, sse,
)
from disagg.worker.server.tokenize_routes import add_tokenize_routes

logger = logging.getLogger(__name__)

Kind = Literal["completion", "chat"]


@dataclass
class ServerState:
    engine_loop: EngineLoop
    role: str  # prefill | decode | both
    draining: bool = False
    kv_events: Any = None  # KVEventsInfo where KV-cache events are published (GET /kv_events), else None
    pd: Any = None  # the prefill pool this decode worker may call behind a gateway (router.state), else None
    early_first_token: bool = True  # behind a gateway: stream the prefill's token first (pd_hop.py)
    # signs the hand-offs this worker answers with and checks those it is given (handoff_auth.py); None: no key,
    # hand-offs are neither signed nor checked
    signer: Any = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # larger request bodies: 413
    body_timeout_s: float = BODY_IDLE_TIMEOUT_S  # a body silent this long: 408
    preparer: Preparer = field(default_factory=Preparer)  # parsing, templates, tokenizing, grammars: off the loop
    _ids: itertools.count = field(default_factory=itertools.count)

    def next_engine_id(self, request_id: str) -> str:
        # the client's X-Request-Id may repeat; the engine's ids must not
        return f"{request_id}#{next(self._ids)}"

    def rejected(self, reason: str) -> None:
        """Count a request refused before the engine (its metrics exist once the engine is loaded)."""
        if self.engine_loop.metrics is not None:
            self.engine_loop.metrics.rejected(reason)


def error_response(e: APIError) -> JSONResponse:
    headers = {"Retry-After": str(e.retry_after_s)} if e.retry_after_s is not None else None
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="disagg worker", docs_url=None, redoc_url=None)
    app.add_middleware(LimitRequestBody, max_bytes=state.max_body_bytes, idle_s=state.body_timeout_s,
                       on_reject=state.rejected)
    loop_ = state.engine_loop

    @app.get("/health")
    async def health() -> Response:
        if loop_.dead:
            return JSONResponse({"status": "error", "reason": loop_.dead}, status_code=500)
        if state.pd is not None and state.pd.down:  # the prefill hop's probes or discovery (supervision.py)
            return JSONResponse({"status": "unhealthy", "down": dict(state.pd.down)}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/ready")
    async def ready() -> Response:
        if state.draining:
            return JSONResponse({"ready": False, "reason": "draining"}, status_code=503)
        if not loop_.ready:
            return JSONResponse({"ready": False, "reason": loop_.dead or "loading"}, status_code=503)
        return JSONResponse({"ready": True, "role": state.role})

    @app.get("/metrics")
    async def metrics() -> Response:
        pages = [loop_.metrics.render() if loop_.metrics is not None else b"",
                 state.pd.metrics.render() if state.pd is not None else b""]
        return Response(merged_metrics(*pages), media_type=CONTENT_TYPE_LATEST)

    @app.get("/kv_events")
    async def kv_events() -> Response:
        """Where this worker publishes KV-cache events (a router subscribes there); 404 when it does not."""
        if state.kv_events is None:
            return error_response(APIError(404, "KV-cache events are off (--kv-events-endpoint)", "NotFoundError"))
        return JSONResponse(dataclasses.asdict(state.kv_events))

    @app.get("/tokenizer")
    async def tokenizer_files() -> Response:
        """The served model's tokenizer files (a prefix-aware router tokenizes prompts as this worker does)."""
        if not loop_.ready:
            return error_response(APIError(503, "model is loading", "service_unavailable"))
        model_dir = Path(loop_.engine.config.model)
        names = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "config.json",
                 "generation_config.json")
        files = {n: (model_dir / n).read_text() for n in names if (model_dir / n).is_file()}
        return JSONResponse({"files": files})

    @app.get("/v1/models")
    async def models() -> Response:
        if not loop_.ready:
            return error_response(APIError(503, "model is loading", "service_unavailable"))
        e = loop_.engine
        return JSONResponse({"object": "list", "data": [{
            "id": e.served_model_name, "object": "model", "created": int(time.time()), "owned_by": "disagg",
            "root": e.config.model, "max_model_len": e.max_model_len,
        }]})

    add_tokenize_routes(app, loop_)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _generate(state, request, "completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _generate(state, request, "chat")

    @app.post(RELEASE_PATH)
    async def release_kv(request: Request) -> Response:
        try:
            return JSONResponse(await _release_kv(state, await request.body()))
        except APIError as e:
            return error_response(e)

    return app


async def _release_kv(state: ServerState, raw: bytes) -> dict[str, Any]:
    """Free the KV this prefill keeps for a hand-off no decode will read (the router's call when every decode
    refused it): body {"kv_transfer_params": the hand-off this worker answered with}. With a hand-off key only
    a hand-off this resource signed, within its lease, is honoured (403 otherwise); 404 when its KV does not wait
    here (pulled, expired, another engine's)."""
    loop_ = state.engine_loop
    if not loop_.ready:
        raise APIError(503, loop_.dead or "model is loading", "service_unavailable")
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(400, f"malformed JSON body: {e}") from None
    if not isinstance(body, dict) or body.get("kv_transfer_params") is None:
        raise APIError(400, "the body must be a JSON object with the hand-off to release in kv_transfer_params",
                       param="kv_transfer_params")
    ktc = loop_.engine.config.kv_transfer_config
    handoff = check_kv_transfer_params(body["kv_transfer_params"], ktc.kv_connector)
    remote = handoff.remote
    if remote is None:
        raise APIError(400, "kv_transfer_params names no remote KV (remote_engine_id, remote_block_ids, ...)",
                       param="kv_transfer_params")
    if state.signer is not None:
        check_signature(state.signer, handoff)
    if remote.engine_id != ktc.engine_id or not await loop_.release_kv(remote.request_id):
        raise APIError(404, f"no KV of request {remote.request_id!r} waits here to be pulled (read already, past "
                       "its lease, or kept by another engine)", "NotFoundError")
    logger.info("released the unread KV of request %s (no decode will pull it)", remote.request_id)
    return {"released": True, "request_id": remote.request_id}


async def _generate(state: ServerState, request: Request, kind: Kind) -> Response:
    raw = await request.body()
    request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
    try:
        _reserve(state)  # before a prefill hop too: a full queue refuses the request before the prefill's work
    except APIError as e:
        return error_response(e)
    try:
        return await _answer(state, request, kind, raw, request_id)
    finally:
        state.engine_loop.release()


async def _answer(state: ServerState, request: Request, kind: Kind, raw: bytes, request_id: str) -> Response:
    first_chunk = None
    target = request.headers.get(PREFILL_HEADER)
    if target and state.pd is not None:
        path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
        prepared = await prefill_remotely(state.pd, path, raw, target, request_id, state.early_first_token,
                                          state.signer)
        if isinstance(prepared, Response):
            return prepared
        raw, first_chunk, verified, ticket = prepared
    else:
        verified, ticket = False, None
    try:
        job = await _admit(state, raw, request_id, kind, verified)
        # the hand-off reached its decode (this engine; its own disagg:kv_pending_loads counts the KV's wait):
        # no longer a pending send in the hop's per-endpoint view (a refused one stays until its lease end)
        settle_handoff(state.pd, ticket, consumed=True)
    except APIError as e:
        if e.status >= 500:
            logger.warning("rejected a request: %s", e.message)
        if ticket is not None:  # this engine never took the hand-off: its prefill frees the KV now
            release_unread(state.pd, ticket, {"X-Request-Id": request_id})
        if first_chunk is not None:  # the 200 and the first token are on their way: end it with the error
            return StreamingResponse(iter([first_chunk, sse(e.body()), sse("[DONE]")]),
                                     media_type="text/event-stream", headers={"X-Request-Id": request_id})
        return error_response(e)
    if first_chunk is not None:
        return StreamingResponse(_after_first_chunk(state, job, first_chunk), media_type="text/event-stream",
                                 headers={"X-Request-Id": job.request_id})
    if job.stream:
        # a request that fails before its first token (e.g. its remote KV did not load under policy fail) gets
        # an error status, not a 200 stream carrying only an error event: wait for the first output first (or
        # for the client to leave: queued, it may wait long)
        answered, first = await unless_disconnected(request, job.sink.get())
        if not answered:
            state.engine_loop.abort(job.engine_id)
            logger.info("client disconnected before the first token; aborted %s", job.engine_id)
            return Response(status_code=499)
        if first is not None and first.finished and first.outputs[0].finish_reason == "error":
            observe(state.engine_loop, first, None)
            return error_response(APIError(500, first.error or "request failed in the engine", "internal_error"))
        return StreamingResponse(stream(state.engine_loop, job, first), media_type="text/event-stream",
                                 headers={"X-Request-Id": job.request_id})
    return await complete(state.engine_loop, request, job)


def _reserve(state: ServerState) -> None:
    """Room for the request in the waiting queue by the engine's last reading (admission.py), or the APIError
    refusing it: 503 while draining or loading, 429 with Retry-After when the queue is full."""
    loop_ = state.engine_loop
    if state.draining:
        raise APIError(503, "server is draining", "service_unavailable")
    if not loop_.ready:
        raise APIError(503, loop_.dead or "model is loading", "service_unavailable")
    try:
        loop_.reserve()
    except QueueFull as e:
        state.rejected(e.reason)
        raise e.api_error() from None


async def _after_first_chunk(state: ServerState, job: Job, first_chunk: bytes) -> Any:
    """The prefill's token at once, then what this engine generates after it (a failure as an SSE event)."""
    yield first_chunk
    first = await job.sink.get()
    async for chunk in stream(state.engine_loop, job, first):
        yield chunk


async def _admit(state: ServerState, raw: bytes, request_id: str, kind: Kind, verified: bool = False) -> Job:
    """Prepare off the event loop (admission.py), check the hand-off and queue (the caller reserved room); every
    rejection is an APIError with an OpenAI-style body (429 with Retry-After when the queue is full). A hand-off
    naming remote KV is checked here, before the engine (and so its connector) sees it, unless `verified` (this
    worker's own prefill hop checked it)."""
    loop_ = state.engine_loop
    if state.draining:  # drained while a prefill hop ran
        raise APIError(503, "server is draining", "service_unavailable")
    engine = loop_.engine
    try:
        prepared = await state.preparer.prepare(engine, raw, kind)
        req, prompt_ids, sp = prepared.request, prepared.prompt_ids, prepared.sampling_params
        handoff = check_kv_transfer_params(req.kv_transfer_params, engine.config.kv_transfer_config.kv_connector)
        if handoff is not None and state.signer is not None and not verified:
            check_signature(state.signer, handoff)
        engine_id = state.next_engine_id(request_id)
        sink = await loop_.add(prompt_ids, sp, engine_id, handoff)
    except PromptTooLong:
        state.rejected("prompt_too_long")
        raise
    except QueueFull as e:
        state.rejected(e.reason)
        raise e.api_error() from None
    except ValueError as e:
        raise APIError(400, str(e)) from None
    except RuntimeError as e:
        raise APIError(503, str(e), "service_unavailable") from None
    prefix = "chatcmpl" if kind == "chat" else "cmpl"
    return Job(kind, request_id, engine_id, f"{prefix}-{request_id}", engine.served_model_name, req.stream,
               bool(req.stream_options and req.stream_options.include_usage), sink, engine.tokenizer, prompt_ids,
               n=sp.n, logprobs=sp.logprobs is not None, echo=bool(getattr(req, "echo", False)),
               prompt_logprobs="prompt_logprobs" in req.model_fields_set,
               tokens_as_ids=req.return_tokens_as_token_ids, prompt_str=_prompt_str(req),
               delivered=len(handoff.delivered_token_ids) if handoff is not None and req.stream else 0,
               handoff_signer=state.signer)


def _prompt_str(req: Any) -> str | None:
    if isinstance(req, CompletionRequest) and isinstance(req.single_prompt(), str):
        return req.single_prompt()
    return None
