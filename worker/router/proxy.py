"""The P/D router's HTTP app: the two-hop flow (prefill with max_tokens=1 and do_remote_decode, then decode
with the returned kv_transfer_params), streamed back to the client.

Retries only where no byte reached the client: a failed prefill hop moves to another prefill endpoint
(none left: decode alone, computing the prompt itself); a decode hop that fails before its first byte
moves to another decode endpoint. A decode stream broken midway ends with an SSE error event.
Every wait is bounded (timeouts.py): a hop that runs past its bound fails over as a failed one does; with no
decode endpoint left the client gets a 504 (503 when none could be reached), never a half-written 200. Failed
endpoints are ejected for a while (outliers.py).
"""
from __future__ import annotations

import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from disagg.worker.kv_transfer.handoff import Handoff, HandoffError
from disagg.worker.router.metrics import CONTENT_TYPE_LATEST, RouterMetrics
from disagg.worker.router.endpoints import Endpoint, EndpointPool
from disagg.worker.router.probes import await_ready
from disagg.worker.router.timeouts import Deadline, HopTimeout, HopTimeouts, within
from disagg.worker.server.protocol import error_body, sse
from disagg.worker.server.responses import body as body_of, delta_choice

logger = logging.getLogger(__name__)


def error_json(status: int, message: str, type_: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, type_, param), status_code=status)


def sse_error(message: str, status: int = 502, type_: str = "upstream_error") -> bytes:
    return sse(error_body(status, message, type_)) + sse("[DONE]")


@dataclass
class RouterState:
    prefill: EndpointPool
    decode: EndpointPool
    metrics: RouterMetrics
    client: httpx.AsyncClient | None = None
    probe_interval_s: float = 1.0
    timeouts: HopTimeouts = field(default_factory=HopTimeouts)
    early_first_token: bool = True  # stream the prefill's token before the decode hop (early_first_chunk)
    prefix: Any = None  # PrefixRouter with --policy prefix-aware (prefix_router.py), else None


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The first hop: compute the prompt, produce one token, keep the KV for the decode worker."""
    # n choices fork on the decode worker from one prefill; logprobs are the decode's to compute
    p = dict(body, max_tokens=1, stream=False, kv_transfer_params=Handoff.prefill_request().to_wire())
    if "n" in p:
        p["n"] = 1
    for name in ("stream_options", "logprobs", "top_logprobs", "echo"):
        p.pop(name, None)
    # the prefill's token may be the one the client gets first (early_first_chunk): it must obey min_tokens too
    if isinstance(p.get("min_tokens"), int) and p["min_tokens"] > 0:
        p["min_tokens"] = 1
    else:
        p.pop("min_tokens", None)
    if "max_completion_tokens" in p:
        p["max_completion_tokens"] = 1
    return p


def needs_prompt_logits(body: dict[str, Any]) -> bool:
    """Prompt logprobs (vLLM's prompt_logprobs, or echo with logprobs) need the logits of every prompt position,
    which only the worker that computes the prompt has: such a request goes to a decode worker alone."""
    return body.get("prompt_logprobs") is not None or bool(body.get("echo") and body.get("logprobs") is not None)


def early_first_chunk(body: dict[str, Any], path: str, answer: Any, kv_params: Handoff | None) -> bytes | None:
    """The client's first SSE chunk, made from the prefill's answer, for a streamed request the decode worker
    can continue after it (kv_transfer_params.output_token_ids: an engine that supports
    delivered_token_ids); None when the decode worker must stream from the first token itself.

    The prefill sampled that token already (max_tokens=1) and its KV is what the decode worker reads, so
    sending it at once takes the decode hop, the KV transfer and the decode's admission out of the time to
    first token. Not for what the one-token answer does not carry as the full request would: logprobs, echo,
    n > 1, and stop strings (a streamed text held back as a possible stop string's start)."""
    if not body.get("stream") or kv_params is None or not isinstance(answer, dict):
        return None
    if len(kv_params.output_token_ids) != 1:
        return None
    if body.get("n") not in (None, 1) or body.get("best_of") not in (None, 1) or body.get("echo") \
            or body.get("logprobs") not in (None, False) or body.get("top_logprobs") is not None \
            or body.get("stop") not in (None, "", []):
        return None
    options = body.get("stream_options")
    if isinstance(options, dict) and options.get("continuous_usage_stats"):
        return None
    chat = path.endswith("/chat/completions")
    try:
        (c,) = answer["choices"]
        text = c["message"]["content"] if chat else c["text"]
        if not isinstance(text, str) or text.endswith("\ufffd"):
            # U+FFFD: the token is part of a character (byte-level tokens); a stream holds such text back until
            # the character is complete, so the decode worker must render it with the tokens that follow
            return None
        kind = "chat" if chat else "completion"
        # the worker's own chunk, with the prefill's id and creation time (the decode worker's chunks share them)
        chunk = body_of(kind, answer["id"], answer["model"], [delta_choice(kind, 0, text, None, None, first=True)],
                        chunk=True, created=answer["created"])
    except (KeyError, TypeError, ValueError):
        return None
    return sse(chunk)


def check_max_tokens(body: dict[str, Any]) -> str | None:
    """The prefill hop overrides max_tokens, so a bad value must be caught before it (else the prefill's KV
    waits for a decode request that the decode worker rejects)."""
    for name in ("max_tokens", "max_completion_tokens"):
        value = body.get(name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            return f"{name} must be an integer >= 1, got {value!r}"
    return None


def build_app(state: RouterState) -> FastAPI:
    app = FastAPI(title="disagg router", docs_url=None, redoc_url=None)

    @app.get("/health")
    async def health() -> Response:
        return JSONResponse({"status": "ok"})

    @app.get("/ready")
    async def ready() -> Response:
        n_decode, n_prefill = len(state.decode.available()), len(state.prefill.available())
        body = {"ready": n_decode > 0, "decode_ready": n_decode, "prefill_ready": n_prefill}
        return JSONResponse(body, status_code=200 if n_decode else 503)

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

    @app.get("/v1/models")
    async def models() -> Response:
        for ep in state.decode.available() + state.prefill.available():
            try:
                r = await state.client.get(f"{ep.url}/v1/models", timeout=5.0)
            except httpx.HTTPError:
                continue
            return Response(r.content, status_code=r.status_code, media_type="application/json")
        return error_json(503, "no worker endpoint is ready", "service_unavailable")

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
        return await route(state, request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await route(state, request, "/v1/chat/completions")

    return app


async def _forward(state: RouterState, method: str, path: str, content: bytes | None) -> Response:
    """A stateless call (tokenize, version) answered by the first ready worker that answers."""
    for ep in state.decode.available() + state.prefill.available():
        try:
            r = await state.client.request(method, f"{ep.url}{path}", content=content, timeout=10.0,
                                           headers={"Content-Type": "application/json"})
        except httpx.HTTPError:
            continue
        return Response(r.content, status_code=r.status_code, media_type="application/json")
    return error_json(503, "no worker endpoint is ready", "service_unavailable")


async def route(state: RouterState, request: Request, path: str) -> Response:
    try:
        body = json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        state.metrics.request("bad_request")
        return error_json(400, f"malformed JSON body: {e}", "invalid_request_error")
    if not isinstance(body, dict):
        state.metrics.request("bad_request")
        return error_json(400, "request body must be a JSON object", "invalid_request_error")
    problem = check_max_tokens(body)
    if problem:
        state.metrics.request("bad_request")
        return error_json(400, problem, "invalid_request_error", problem.split(" ", 1)[0])
    request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
    headers = {"X-Request-Id": request_id}
    deadline = Deadline(state.timeouts)
    kv_params: Handoff | None = None
    revision: set[str | None] | None = None
    first_chunk: bytes | None = None
    plan = await state.prefix.plan_request(body, path, state.prefill, state.decode, state.client) \
        if state.prefix is not None else None
    if plan is not None and plan.skip_prefill and state.prefill.endpoints:
        state.metrics.skipped_prefill()  # decode holds (nearly) the whole prompt: no KV to move
    elif state.prefill.endpoints and not needs_prompt_logits(body):
        outcome = await _prefill_hop(state, path, body, headers, deadline, plan.prefill_costs if plan else None)
        if isinstance(outcome, Response):  # the request itself is bad: the decode worker would say the same
            state.metrics.request("bad_request")
            return outcome
        kv_params, prefill_revision, answer = outcome
        revision = {prefill_revision} if kv_params else None
        if not kv_params:
            state.metrics.fell_back_to_decode_alone()
        elif state.early_first_token:
            first_chunk = early_first_chunk(body, path, answer, kv_params)
    costs = plan.decode_costs if plan else None
    if first_chunk is not None:
        return _continue_after_first_chunk(state, path, body, kv_params, first_chunk, headers, deadline, revision,
                                           costs)
    return await _decode_hop(state, path, body, kv_params, headers, deadline, stream=bool(body.get("stream")),
                             revisions=revision, costs=costs)


async def _prefill_hop(state: RouterState, path: str, body: dict[str, Any], headers: dict[str, str],
                       deadline: Deadline, costs: dict[str, float] | None = None
                       ) -> tuple[Handoff | None, str | None, Any] | Response:
    """(the hand-off for the decode hop, the prefill endpoint's revision, its answer); None when no
    prefill endpoint could do it (decode alone); a Response to pass back when the prefill rejected
    the request (4xx). Prefill endpoints whose revision has a ready decode endpoint go first."""
    tried: set[str] = set()
    p_body = prefill_body(body)
    while deadline.remaining() > 0 and \
            (ep := state.prefill.pick(tried, revisions=state.decode.ready_revisions(), costs=costs)) is not None:
        tried.add(ep.url)
        ep.outstanding += 1
        start = time.monotonic()
        try:  # the answer is one token: its first byte comes with the rest
            r = await within(state.client.post(ep.url + path, json=p_body, headers=headers,
                                               timeout=deadline.httpx_timeout()), deadline, "first_byte",
                       hung=ep.unresponsive)
        except HopTimeout as e:
            _hop_timed_out(state, state.prefill, ep, "prefill", start, e)
            continue
        except httpx.HTTPError as e:
            _hop_failed(state, state.prefill, ep, "prefill", start, f"{type(e).__name__}: {e}")
            continue
        finally:
            ep.outstanding -= 1
        if r.status_code >= 500:
            _hop_failed(state, state.prefill, ep, "prefill", start, f"HTTP {r.status_code}: {r.text[:200]}")
            continue
        state.metrics.hop("prefill", time.monotonic() - start, error=False)
        state.prefill.mark_ok(ep)
        if r.status_code >= 400:
            return Response(r.content, status_code=r.status_code, media_type="application/json", headers=headers)
        try:
            answer = r.json()
            params = answer.get("kv_transfer_params")
        except (json.JSONDecodeError, AttributeError):
            logger.warning("prefill %s answered without JSON; decoding alone", ep.url)
            return None, None, None
        try:
            handoff = Handoff.parse(params) if params else None
        except HandoffError as e:
            logger.warning("prefill %s answered a malformed hand-off (%s); decoding alone", ep.url, e)
            return None, None, None
        return handoff, ep.revision, answer
    if state.prefill.endpoints:
        logger.warning("request %s: no prefill endpoint available (%d known); decode computes the prompt",
                       headers["X-Request-Id"], len(state.prefill.endpoints))
    return None, None, None


def _hop_failed(state: RouterState, pool: EndpointPool, ep: Endpoint, hop: str, start: float, why: str,
                timed_out: bool = False) -> None:
    logger.warning("%s hop to %s failed: %s", hop, ep.url, why)
    state.metrics.hop(hop, time.monotonic() - start, error=True)
    _eject_if(state, hop, ep, pool.mark_failed(ep, timed_out))


def _eject_if(state: RouterState, hop: str, ep: Endpoint, ejected_s: float | None) -> None:
    """Tell an ejection mark_failed just made (None: none)."""
    if ejected_s is not None:
        logger.warning("%s endpoint %s ejected for %g s (ejection %d in a row)", hop, ep.url, ejected_s,
                       ep.health.ejections)
        state.metrics.ejected(hop)


def _hop_timed_out(state: RouterState, pool: EndpointPool, ep: Endpoint, hop: str, start: float,
                   e: HopTimeout) -> None:
    state.metrics.timed_out(hop, e.stage)
    _hop_failed(state, pool, ep, hop, start, f"timed out ({e.stage}): {e}", timed_out=True)


async def _decode_hop(state: RouterState, path: str, body: dict[str, Any], kv_params: Handoff | None,
                      headers: dict[str, str], deadline: Deadline, stream: bool,
                      revisions: set[str | None] | None = None, costs: dict[str, float] | None = None) -> Response:
    alone = {k: v for k, v in body.items() if k != "kv_transfer_params"}
    d_body = {**alone, "kv_transfer_params": kv_params.to_wire()} if kv_params else alone
    opened = await _open_decode(state, path, d_body, alone, headers, deadline, stream, revisions, costs)
    if isinstance(opened, Response):
        return opened
    return StreamingResponse(_relay(state, *opened, deadline), media_type="text/event-stream", headers=headers)


def _continue_after_first_chunk(state: RouterState, path: str, body: dict[str, Any], kv_params: Handoff,
                                first_chunk: bytes, headers: dict[str, str], deadline: Deadline,
                                revisions: set[str | None] | None, costs: dict[str, float] | None) -> Response:
    """The stream starts with the prefill's token (early_first_chunk); a decode worker continues after it
    (delivered_token_ids). The 200 is sent with that chunk, so a decode hop that fails from here on ends the
    stream with an SSE error event, as a stream broken midway does."""
    delivered = kv_params.output_token_ids
    bare = {k: v for k, v in body.items() if k != "kv_transfer_params"}
    # decoding alone (no decode of the prefill's revision is left) still continues after the delivered token
    alone = {**bare, "kv_transfer_params": Handoff.delivered_only(delivered).to_wire()}
    d_body = {**bare, "kv_transfer_params": kv_params.delivering(delivered).to_wire()}
    state.metrics.first_byte(time.monotonic() - deadline.started)
    state.metrics.early_first_token()

    async def chunks() -> AsyncIterator[bytes]:
        yield first_chunk
        opened = await _open_decode(state, path, d_body, alone, headers, deadline, True, revisions, costs,
                                    count_first_byte=False)
        if isinstance(opened, Response):  # no decode worker took it: what it would have said, as an event
            yield _as_sse_error(opened)
            return
        async for chunk in _relay(state, *opened, deadline):
            yield chunk

    return StreamingResponse(chunks(), media_type="text/event-stream", headers=headers)


def _as_sse_error(resp: Response) -> bytes:
    try:
        err = json.loads(bytes(resp.body))["error"]
        return sse_error(err["message"], resp.status_code, err.get("type") or "upstream_error")
    except (ValueError, KeyError, TypeError):
        return sse_error(bytes(resp.body).decode(errors="replace")[:500] or f"HTTP {resp.status_code}",
                         resp.status_code)


async def _open_decode(state: RouterState, path: str, d_body: dict[str, Any], alone: dict[str, Any],
                       headers: dict[str, str], deadline: Deadline, stream: bool,
                       revisions: set[str | None] | None, costs: dict[str, float] | None,
                       count_first_byte: bool = True
                       ) -> tuple[Endpoint, httpx.Response, bytes, AsyncIterator[bytes], float] | Response:
    """A decode endpoint's answer: a stream that has its first byte (ep, response, first bytes, the rest,
    hop start), or a Response to give the client (the whole answer when not streamed, or why none came)."""
    tried: set[str] = set()
    timed_out: str | None = None  # the last hop that ran past a bound: "url: why"
    # a non-streamed answer has no first byte before it is complete: only the total bounds it
    stage = "first_byte" if stream else "total"
    waited = False
    while deadline.remaining() > 0:
        ep = state.decode.pick(tried, revisions=revisions, costs=costs)
        if ep is None:
            # none ready: one that answers its probes (a pod just started, in a rollout's hand-over) may be
            # ready within the connect bound - wait for it once rather than refuse at once
            if waited or tried or not await await_ready(state, state.decode, deadline):
                break
            waited = True
            continue
        tried.add(ep.url)
        if d_body is not alone and revisions is not None and ep.revision not in revisions:
            # no decode of the prefill's revision is left (a rollout removed it): KV of another revision may
            # not fit this engine, so it computes the prompt itself; prefill's blocks go at the lease
            logger.info("request %s: decode %s is of revision %s, not the prefill's; decoding alone",
                        headers["X-Request-Id"], ep.url, ep.revision)
            state.metrics.fell_back_to_decode_alone()
            d_body = alone
        ep.outstanding += 1
        start = time.monotonic()
        resp = None
        try:
            request = state.client.build_request("POST", ep.url + path, json=d_body, headers=headers,
                                                 timeout=deadline.httpx_timeout())
            resp = await within(state.client.send(request, stream=True), deadline, stage, since=start,
                                hung=ep.unresponsive)
            if resp.status_code >= 500:
                await within(resp.aread(), deadline, "idle")
                raise httpx.HTTPStatusError(f"HTTP {resp.status_code}: {resp.text[:200]}", request=resp.request,
                                            response=resp)
            if resp.status_code >= 400 or not stream:
                # a broken or abandoned body is retried: nothing was sent yet
                content = await within(resp.aread(), deadline, stage, since=start, hung=ep.unresponsive)
                await resp.aclose()
                ep.outstanding -= 1
                state.metrics.hop("decode", time.monotonic() - start, error=False)
                state.decode.mark_ok(ep)
                state.metrics.request("ok" if resp.status_code < 400 else "bad_request")
                return Response(content, status_code=resp.status_code, media_type="application/json",
                                headers=headers)
            chunks = resp.aiter_raw()
            # before the first byte, a failure can still be retried
            first = await within(chunks.__anext__(), deadline, "first_byte", since=start, hung=ep.unresponsive)
        except (HopTimeout, httpx.HTTPError, StopAsyncIteration) as e:
            if resp is not None:
                await resp.aclose()
            ep.outstanding -= 1
            if isinstance(e, HopTimeout):
                _hop_timed_out(state, state.decode, ep, "decode", start, e)
                timed_out = f"{ep.url}: {e}"
            else:
                _hop_failed(state, state.decode, ep, "decode", start, f"{type(e).__name__}: {e}")
            continue
        state.decode.mark_ok(ep)
        if count_first_byte:
            state.metrics.first_byte(time.monotonic() - deadline.started)
        return ep, resp, first, chunks, start
    return _no_decode_answer(state, tried, timed_out, deadline)


def _no_decode_answer(state: RouterState, tried: set[str], timed_out: str | None, deadline: Deadline) -> Response:
    """Nothing was sent to the client yet: a 504 when a bound ran out, else a 503."""
    known = len(state.decode.endpoints)
    if timed_out is not None or deadline.remaining() <= 0:
        state.metrics.request("timeout")
        last = f"; last: {timed_out}" if timed_out else ""
        return error_json(504, f"no decode worker answered within the router's bounds (request total "
                          f"{deadline.timeouts.total_s:g} s; {known} known, {len(tried)} tried{last})", "timeout")
    state.metrics.request("unavailable")
    return error_json(503, f"no decode endpoint available ({known} known, {len(tried)} tried)",
                      "service_unavailable")


async def _relay(state: RouterState, ep: Endpoint, resp: httpx.Response, first: bytes,
                 chunks: AsyncIterator[bytes], start: float, deadline: Deadline) -> AsyncIterator[bytes]:
    """The stream has started (200 sent): a failure now ends it with an SSE error event, counted."""
    cause = None
    try:
        yield first
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
            _eject_if(state, "decode", ep, state.decode.mark_failed(ep, timed_out=True))
        yield sse_error(f"decode worker {ep.url} timed out mid-stream: {e}", 504, "timeout")
    except httpx.HTTPError as e:  # the decode worker went away mid-stream: end the stream cleanly
        cause = "error"
        logger.warning("decode stream from %s broke: %s: %s", ep.url, type(e).__name__, e)
        _eject_if(state, "decode", ep, state.decode.mark_failed(ep))
        yield sse_error(f"decode worker {ep.url} failed mid-stream: {type(e).__name__}")
    finally:
        ep.outstanding -= 1
        state.metrics.hop("decode", time.monotonic() - start, error=cause is not None)
        state.metrics.request("upstream_error" if cause == "error" else "timeout" if cause else "ok")
        if cause is not None:
            state.metrics.stream_broken(cause)
        await resp.aclose()
