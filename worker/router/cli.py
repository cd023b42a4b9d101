"""`disagg router`: the P/D proxy in front of prefill and decode workers (static URLs, a JSON endpoints file
rewritten at run time, or Kubernetes pods)."""
from __future__ import annotations

import argparse
import contextlib
import logging
from typing import Any

import uvicorn

from disagg.worker.router.routing import GracefulServer, add_routing_arguments, build_routing

logger = logging.getLogger("disagg.worker.router")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_routing_arguments(p)
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--no-early-first-token", dest="early_first_token", action="store_false",
                   help="stream a P/D request's first token from the decode worker, not from the prefill's answer "
                        "(a decode hop that fails is then a 5xx status, not an SSE error event after that token)")
    p.add_argument("--drain-timeout", type=float, default=120.0,
                   help="seconds to wait for open requests after SIGTERM")
    p.add_argument("--log-level", default="INFO")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per probe otherwise
    from disagg.worker.router.app import build_app

    try:
        routing = build_routing(args, early_first_token=args.early_first_token)
    except (ValueError, FileNotFoundError) as e:
        logger.error("%s", e)
        return 2
    state = routing.state
    app = build_app(state)

    @contextlib.asynccontextmanager
    async def lifespan(_app: Any) -> Any:
        async with routing.running():
            logger.info("routing: prefill=%s decode=%s policy=%s", list(state.prefill.endpoints),
                        list(state.decode.endpoints), args.policy)
            yield

    app.router.lifespan_context = lifespan
    server = GracefulServer(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level.lower(),
                                    timeout_graceful_shutdown=args.drain_timeout, access_log=False))
    server.run()
    return 0 if server.started else 1
