"""`disagg pd-proxy`: what stands in front of a vLLM worker in its pod (vLLM listens on loopback only), so that a
vLLM pod does what our worker does natively:
  - prefill: vLLM's hand-off (kv_transfer_params) is signed for this resource (handoff_auth.py), with the lease
    vLLM keeps unread KV for, before it leaves the pod;
  - decode: a hand-off is checked before vLLM sees it (a missing, forged, expired, replayed or other-resource one
    is a 403 and vLLM connects nowhere); a gateway's request naming a prefill endpoint (x-prefiller-host-port)
    gets its prefill hop here (decode_side.py: only to a prefill pod of this resource), then vLLM decodes;
  - /ready turns 503 at SIGTERM (vLLM has no /ready), everything else passes through to vLLM unchanged;
  - the client's Authorization passes through (vLLM checks its own --api-key / $VLLM_API_KEY), on the prefill
    hop too.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import time
import uuid
from typing import Any

import httpx
from fastapi import Request  # at module level: the routes' annotations are strings FastAPI resolves here

logger = logging.getLogger("disagg.worker.pd_proxy")

HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "content-length",
              "host", "proxy-authorization", "proxy-connection"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    from disagg.worker.body_limit import add_body_arguments
    from disagg.worker.router.routing import add_routing_arguments

    add_routing_arguments(p)  # where this resource's prefill pods are (the decode side's allowlist)
    p.add_argument("--role", choices=["prefill", "decode"], required=True)
    p.add_argument("--engine-url", required=True, help="the engine behind this proxy, e.g. http://127.0.0.1:8001")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--kv-lease-seconds", type=float, default=30.0,
                   help="prefill: how long the engine keeps KV nobody pulled (its hand-off's lease end)")
    p.add_argument("--drain-timeout", type=float, default=120.0,
                   help="seconds to wait for open requests after SIGTERM")
    add_body_arguments(p)
    p.add_argument("--log-level", default="INFO")
    p.add_argument("engine_command", nargs=argparse.REMAINDER, metavar="-- ENGINE COMMAND",
                   help="start the engine as this proxy's child (`disagg up`: `-- vllm serve ...`): it gets SIGTERM "
                        "once the proxy has drained, and the proxy exits when it does; in a pod the engine is a "
                        "container of its own and this is left out")


def build_app(state: Any, engine_url: str, role: str, signer: Any, lease_s: float) -> Any:
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, Response, StreamingResponse

    from disagg.worker.router.app import to_response
    from disagg.worker.router.hop_bodies import RELEASE_PATH

    app = FastAPI(title="disagg pd-proxy", docs_url=None, redoc_url=None)
    app.state.server = None  # the GracefulServer (its `draining` flag), set by run()

    @app.get("/ready")
    async def ready() -> Response:
        """Ready when the engine is, as this proxy's own view of it says: the probe updates the endpoint its
        hops use, so a router that saw this pod ready is never refused by the proxy for an engine it has not
        yet probed (a worker coming back from zero)."""
        from disagg.worker.router.probes import probe_endpoint

        if app.state.server is not None and app.state.server.draining:
            return JSONResponse({"ready": False, "reason": "draining"}, status_code=503)
        (engine,) = state.decode.endpoints.values()
        if not await probe_endpoint(state, engine):
            return JSONResponse({"ready": False, "reason": "engine not ready"}, status_code=503)
        return JSONResponse({"ready": True, "role": role}, status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        """The engine's page, then this proxy's (its hops, and the KV hand-offs it saw per endpoint)."""
        from disagg.worker.router.metrics import CONTENT_TYPE_LATEST

        try:
            r = await state.probes.get(f"{engine_url}/metrics", timeout=5.0)
            engine_page = r.content if r.status_code == 200 else b""
        except httpx.HTTPError:
            engine_page = b""
        if engine_page and not engine_page.endswith(b"\n"):
            engine_page += b"\n"
        return Response(engine_page + state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return to_response(await generate(state, request, "/v1/completions", engine_url, role, signer, lease_s))

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return to_response(await generate(state, request, "/v1/chat/completions", engine_url, role, signer,
                                          lease_s))

    @app.post(RELEASE_PATH)
    async def release_kv() -> Response:
        """vLLM has no call to free a finished prefill's KV before its lease ends (kv_lease_duration): the
        router's release is answered 501, and it does not ask this endpoint again."""
        from disagg.worker.router.replies import error_reply

        return to_response(error_reply(501, "this engine (vLLM) cannot free unread KV before its lease ends",
                                        "not_implemented"))

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"])
    async def passthrough(path: str, request: Request) -> Response:
        upstream = state.client.build_request(
            request.method, f"{engine_url}/{path}", params=request.query_params, content=await request.body(),
            headers={k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP},
            timeout=httpx.Timeout(10.0, read=None))
        try:
            r = await state.client.send(upstream, stream=True)
        except httpx.HTTPError as e:
            return JSONResponse({"error": {"message": f"engine unreachable: {type(e).__name__}", "code": 502}},
                                status_code=502)

        async def body() -> Any:
            try:
                async for chunk in r.aiter_raw():
                    yield chunk
            finally:
                await r.aclose()

        headers = {k: v for k, v in r.headers.items() if k.lower() not in HOP_BY_HOP}
        return StreamingResponse(body(), status_code=r.status_code, headers=headers)

    return app


async def generate(state: Any, request: Any, path: str, engine_url: str, role: str, signer: Any,
                   lease_s: float) -> Any:
    """The request's answer. The client's Authorization goes along on every hop (vLLM checks its own
    --api-key; the prefill hop's pd-proxy passes it on to its vLLM) and never comes back in the answer. A client
    that leaves cancels it (vLLM sees the connection close and aborts)."""
    from disagg.worker.router.app import answered

    await request.body()  # read (and kept) first: the disconnect watch reads the messages after it
    reply = await answered(state, request, _generate(state, request, path, engine_url, role, signer, lease_s))
    if reply.headers:
        reply.headers = {k: v for k, v in reply.headers.items() if k.lower() != "authorization"}
    return reply


async def _generate(state: Any, request: Any, path: str, engine_url: str, role: str, signer: Any,
                    lease_s: float) -> Any:
    from disagg.worker.kv_transfer.handoff import Handoff, HandoffError
    from disagg.worker.kv_transfer.handoff_auth import HandoffRejected
    from disagg.worker.router.decode_side import PREFILL_HEADER, prefill_for
    from disagg.worker.router.hop_bodies import HANDOFF_FIELD
    from disagg.worker.router.hops import open_decode
    from disagg.worker.router.policy import RoutePlan
    from disagg.worker.router.relay import relay
    from disagg.worker.router.replies import Reply, error_reply
    from disagg.worker.router.timeouts import Deadline

    try:
        body = json.loads(await request.body())
    except (ValueError, UnicodeDecodeError) as e:
        return error_reply(400, f"malformed JSON body: {e}", "invalid_request_error")
    if not isinstance(body, dict):
        return error_reply(400, "request body must be a JSON object", "invalid_request_error")
    headers = {"X-Request-Id": request.headers.get("x-request-id") or uuid.uuid4().hex}
    if request.headers.get("authorization"):
        headers["Authorization"] = request.headers["authorization"]
    deadline = Deadline(state.timeouts)
    if role == "prefill":
        return await _prefill(state, engine_url, path, body, headers, deadline, signer, lease_s)
    handoff, ticket = None, None  # ticket: the hand-off of this proxy's own prefill hop, in its ledger
    if body.get(HANDOFF_FIELD) is not None:
        try:
            handoff = Handoff.parse(body[HANDOFF_FIELD])
            if signer is not None:
                signer.verify(handoff)
        except (HandoffError, HandoffRejected) as e:
            status = getattr(e, "status", 400)
            return error_reply(status, str(e), "invalid_request_error" if status == 400 else "permission_denied",
                               e.param)
    elif (target := request.headers.get(PREFILL_HEADER)) and state.prefill.endpoints is not None:
        outcome = await prefill_for(state, target, path, body, headers)
        if isinstance(outcome, Reply):
            return outcome
        handoff, ticket = outcome.handoff, outcome.ticket
        if handoff is not None and signer is not None:
            try:
                signer.verify(handoff)
            except HandoffRejected as e:
                logger.warning("request %s: the prefill's hand-off is refused (%s); decoding alone",
                               headers["X-Request-Id"], e)
                handoff = None
    d_body = {**body, HANDOFF_FIELD: handoff.to_wire()} if handoff else \
        {k: v for k, v in body.items() if k != HANDOFF_FIELD}
    alone = {k: v for k, v in body.items() if k != HANDOFF_FIELD}
    # with the ticket, the engine's first byte ends the pending send (else it read pending until its lease end)
    opened = await open_decode(state, RoutePlan(), path, d_body, alone, headers, deadline,
                               bool(body.get("stream")), None, ticket=ticket)
    if isinstance(opened, Reply):
        return opened
    return Reply(200, stream=relay(state, opened, deadline), headers=headers)


async def _prefill(state: Any, engine_url: str, path: str, body: dict[str, Any], headers: dict[str, str],
                   deadline: Any, signer: Any, lease_s: float) -> Any:
    """The engine's answer, its hand-off signed with the lease the engine keeps the KV for."""
    from disagg.worker.kv_transfer.handoff import Handoff, HandoffError
    from disagg.worker.router.hop_bodies import HANDOFF_FIELD
    from disagg.worker.router.hops import open_decode
    from disagg.worker.router.policy import RoutePlan
    from disagg.worker.router.relay import relay
    from disagg.worker.router.replies import Reply

    opened = await open_decode(state, RoutePlan(), path, body, body, headers, deadline, bool(body.get("stream")),
                               None)
    if not isinstance(opened, Reply):
        return Reply(200, stream=relay(state, opened, deadline), headers=headers)
    if opened.status != 200 or signer is None:
        return opened
    try:
        answer = json.loads(opened.content)
        params = answer.get(HANDOFF_FIELD)
        handoff = Handoff.parse(params) if params else None
    except (ValueError, AttributeError, HandoffError):
        return opened
    if handoff is None or handoff.remote is None:
        return opened
    leased = dataclasses.replace(handoff.remote, lease_expires_at=time.time() + lease_s)
    answer[HANDOFF_FIELD] = signer.sign(dataclasses.replace(handoff, remote=leased)).to_wire()
    return Reply(200, json.dumps(answer).encode(), headers=opened.headers)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    from disagg.worker.body_limit import LimitRequestBody, body_limit_problems
    from disagg.worker.kv_transfer.handoff_auth import signer_from_env
    from disagg.worker.router.routing import GracefulServer, build_routing, graceful_config

    try:
        if problems := body_limit_problems(args):
            raise ValueError("; ".join(problems))
        args.decode = [args.engine_url]  # the one decode "pool" member: the engine behind this proxy
        routing = build_routing(args, metrics_role=args.role, need_decode=False)
        # named as its pod (POD_NAME: the downward API, or disagg up's process name) in the per-endpoint metrics
        routing.state.decode.set_urls(args.decode, names={args.engine_url: os.environ.get("POD_NAME", "")})
        signer = signer_from_env()
    except (ValueError, OSError) as e:
        logger.error("%s", e)
        return 2
    if signer is None:
        logger.warning("no hand-off key ($DISAGG_HANDOFF_KEY): hand-offs are neither signed nor checked; run "
                       "only on a network no one else reaches")
    app = build_app(routing.state, args.engine_url.rstrip("/"), args.role, signer, args.kv_lease_seconds)
    app.add_middleware(LimitRequestBody, max_bytes=args.max_request_body_bytes, idle_s=args.request_body_timeout)

    @contextlib.asynccontextmanager
    async def lifespan(_app: Any) -> Any:
        async with routing.running():
            yield

    app.router.lifespan_context = lifespan
    server = GracefulServer(graceful_config(app, args.drain_timeout, host=args.host, port=args.port,
                                            log_level=args.log_level.lower()),
                            routing.state.drain, drain_timeout_s=args.drain_timeout)
    app.state.server = server
    command = args.engine_command[1:] if args.engine_command[:1] == ["--"] else args.engine_command
    with _engine_child(command, server, args.drain_timeout) as engine:
        server.run()
    if engine is not None and engine.returncode not in (0, None) and not server.draining:
        logger.error("the engine exited with status %s", engine.returncode)
        return 1
    return 0 if server.started else 1


@contextlib.contextmanager
def _engine_child(command: list[str], server: Any, drain_s: float) -> Any:
    """The engine as this process's child (when a command is given): started before serving, watched (its exit
    stops the proxy), and SIGTERMed after the proxy drained, given the drain time to stop."""
    if not command:
        yield None
        return
    import signal
    import subprocess
    import threading

    from disagg.worker.local.process import die_with_parent, kill_group

    # its own process group: an engine killed mid-start (vLLM loading) leaves its engine-core processes behind,
    # and they are killed with the group
    engine = subprocess.Popen(command, preexec_fn=die_with_parent, start_new_session=True)
    logger.info("engine started (pid %d): %s", engine.pid, " ".join(command[:3]))

    def watch() -> None:
        engine.wait()
        if not server.should_exit:
            logger.error("the engine exited (status %s); stopping", engine.returncode)
            server.should_exit = True

    threading.Thread(target=watch, name="engine-watch", daemon=True).start()
    try:
        yield engine
    finally:
        if engine.poll() is None:
            engine.send_signal(signal.SIGTERM)
            try:
                engine.wait(drain_s + 10)
            except subprocess.TimeoutExpired:
                logger.error("the engine did not stop within %.0f s; killing it", drain_s + 10)
                engine.kill()
                engine.wait()
        if kill_group(engine.pid):
            logger.warning("the engine left processes running; killed them")
