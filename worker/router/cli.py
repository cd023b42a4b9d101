"""`disagg router`: the P/D proxy in front of prefill and decode workers (static URLs, a JSON endpoints file
rewritten at run time, or Kubernetes pods)."""
from __future__ import annotations

import argparse
import contextlib
import logging
from typing import Any

from disagg.worker.api_keys import RequireApiKey, add_client_key_arguments, client_keys
from disagg.worker.body_limit import LimitRequestBody, add_body_arguments, body_limit_problems
from disagg.worker.router.draining import DRAIN_DELAY_S, DRAIN_TIMEOUT_S
from disagg.worker.router.parser_door import refusing_protocol
from disagg.worker.router.routing import (IN_FLIGHT_CEILING, GracefulServer, add_routing_arguments, build_routing,
                                         graceful_config)
from disagg.worker.router.waiting_room import DEFAULT_MAX_IN_FLIGHT_PER_ENDPOINT

logger = logging.getLogger("disagg.worker.router")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_routing_arguments(p)
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--no-early-first-token", dest="early_first_token", action="store_false",
                   help="stream a P/D request's first token from the decode worker, not from the prefill's answer "
                        "(a decode hop that fails is then a 5xx status, not an SSE error event after that token)")
    p.add_argument("--drain-delay", type=float, default=DRAIN_DELAY_S,
                   help="seconds after SIGTERM during which /ready answers 503 and requests are still served, "
                        "before the listener closes")
    p.add_argument("--drain-timeout", type=float, default=DRAIN_TIMEOUT_S,
                   help="seconds open requests get once the listener closed; then each open stream ends with an "
                        "SSE error event and each waiting request with a 503")
    p.add_argument("--max-in-flight-per-endpoint", type=int, default=DEFAULT_MAX_IN_FLIGHT_PER_ENDPOINT,
                   metavar="N", help="generation requests served at once, per ready decode worker (and "
                   f"{IN_FLIGHT_CEILING} in all: half the connections to the workers); more are answered 429 with "
                   "Retry-After before their body is parsed (0: no bound per worker)")
    add_body_arguments(p)
    add_client_key_arguments(p)
    p.add_argument("--tls-cert-file", metavar="PEM", help="serve HTTPS with this certificate (chain); needs "
                   "--tls-key-file")
    p.add_argument("--tls-key-file", metavar="PEM", help="the certificate's private key")
    p.add_argument("--log-level", default="INFO")


def tls_options(args: argparse.Namespace) -> dict[str, str]:
    """uvicorn's ssl options from --tls-cert-file/--tls-key-file (both or neither; ValueError otherwise)."""
    if bool(args.tls_cert_file) != bool(args.tls_key_file):
        raise ValueError("--tls-cert-file and --tls-key-file go together")
    return {"ssl_certfile": args.tls_cert_file, "ssl_keyfile": args.tls_key_file} if args.tls_cert_file else {}


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per probe otherwise
    from disagg.worker.router.app import build_app

    try:
        routing = build_routing(args, early_first_token=args.early_first_token)
        keys = client_keys(args.api_key_file)
        tls = tls_options(args)
        if args.drain_delay < 0 or args.drain_timeout < 0:
            raise ValueError(f"--drain-delay and --drain-timeout must be >= 0 seconds, got {args.drain_delay} and "
                             f"{args.drain_timeout}")
        if args.max_in_flight_per_endpoint < 0:
            raise ValueError(f"--max-in-flight-per-endpoint must be >= 0, got {args.max_in_flight_per_endpoint}")
        if problems := body_limit_problems(args):
            raise ValueError("; ".join(problems))
    except (ValueError, FileNotFoundError) as e:
        logger.error("%s", e)
        return 2
    state = routing.state
    app = build_app(state)
    app.add_middleware(LimitRequestBody, max_bytes=args.max_request_body_bytes, idle_s=args.request_body_timeout)
    if keys is not None:
        app.add_middleware(RequireApiKey, keys=keys)
    else:
        logger.info("no API key (--api-key-file, $DISAGG_API_KEY): anyone who reaches this router may use it")

    @contextlib.asynccontextmanager
    async def lifespan(_app: Any) -> Any:
        async with routing.running():
            logger.info("routing: prefill=%s decode=%s policy=%s", list(state.prefill.endpoints),
                        list(state.decode.endpoints), args.policy)
            yield

    app.router.lifespan_context = lifespan
    protocol = refusing_protocol(state, keys)  # the in-flight bound's 429s answered at the HTTP parser
    server = GracefulServer(graceful_config(app, args.drain_timeout, host=args.host, port=args.port,
                                            log_level=args.log_level.lower(), http=protocol or "auto", **tls),
                            state.drain, args.drain_delay, args.drain_timeout)
    server.run()
    return 0 if server.started else 1
