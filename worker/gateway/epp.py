"""`disagg epp`: the endpoint picker a Gateway API inference gateway calls (Envoy's ext_proc over gRPC) - the
router's routing core (discovery, probes, policy, prefix facts, revision pairing, ejection) picking for the
gateway instead of proxying itself. The gateway then sends the request straight to the decode pod, which runs
the prefill hop (x-prefiller-host-port) itself.

Ports: --grpc-port (ext_proc, 9002 as in GIE's conformance), --health-port (gRPC health: services "",
"liveness", "readiness" and the ext_proc service's name), --metrics-port (HTTP: /health, /ready, /endpoints,
/metrics). SIGTERM: readiness turns NOT_SERVING, the streams of requests in flight get --drain-timeout, then
it exits.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import threading
from typing import Any

logger = logging.getLogger("disagg.worker.gateway")

EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
HEALTH_SERVICES = ("", "liveness", "readiness", EXT_PROC_SERVICE)
STOP_HANG_S = 10.0  # grpcio's stop() has hung (a peer closing in the same instant): exit anyway after this


def add_arguments(p: argparse.ArgumentParser) -> None:
    from disagg.worker.api_keys import add_client_key_arguments
    from disagg.worker.router.routing import add_routing_arguments

    add_routing_arguments(p)
    p.add_argument("--host", default="0.0.0.0", help="address every port binds")
    p.add_argument("--grpc-port", type=int, default=9002, help="Envoy's ext_proc gRPC service")
    p.add_argument("--health-port", type=int, default=9003, help="gRPC health checking")
    p.add_argument("--metrics-port", type=int, default=9090, help="HTTP /health, /ready, /endpoints, /metrics")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds the requests in flight keep their streams after SIGTERM")
    add_client_key_arguments(p)
    p.add_argument("--log-level", default="INFO")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    from disagg.worker.api_keys import client_keys
    from disagg.worker.router.routing import build_routing

    try:
        routing = build_routing(args, metrics_role="epp")
        keys = client_keys(args.api_key_file)
    except (ValueError, FileNotFoundError) as e:
        logger.error("%s", e)
        return 2
    try:
        return asyncio.run(_serve(args, routing, keys))
    except OSError as e:  # a port in use
        logger.error("%s", e)
        return 1


async def _serve(args: argparse.Namespace, routing: Any, keys: Any) -> int:
    import grpc
    import uvicorn
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
    from fastapi import FastAPI
    from grpc_health.v1 import _async as health_async, health_pb2, health_pb2_grpc

    from disagg.worker.gateway.ext_proc import EndpointPickerService
    from disagg.worker.gateway.picker import AuthenticatingPicker, RoutingPicker
    from disagg.worker.router.app import add_status_routes

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with routing.running() as state:
        picker: Any = RoutingPicker(state)
        if keys is not None or routing.worker_api_key:
            picker = AuthenticatingPicker(picker, keys, routing.worker_api_key)
        server = grpc.aio.server()
        ep_grpc.add_ExternalProcessorServicer_to_server(EndpointPickerService(picker), server)
        server.add_insecure_port(f"{args.host}:{args.grpc_port}")
        health = health_async.HealthServicer()
        health_server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(health, health_server)
        health_server.add_insecure_port(f"{args.host}:{args.health_port}")
        app = FastAPI(title="disagg endpoint picker", docs_url=None, redoc_url=None)
        add_status_routes(app, state)
        http = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.metrics_port, access_log=False,
                                             log_level=args.log_level.lower()))
        http.install_signal_handlers = lambda: None  # this loop's handlers stop everything
        await server.start()
        await health_server.start()
        http_task = asyncio.ensure_future(http.serve())
        for service in HEALTH_SERVICES:
            await health.set(service, health_pb2.HealthCheckResponse.SERVING)
        logger.info("endpoint picker: ext_proc %s:%d, health :%d, http :%d; prefill=%s decode=%s policy=%s",
                    args.host, args.grpc_port, args.health_port, args.metrics_port, list(state.prefill.endpoints),
                    list(state.decode.endpoints), args.policy)
        await stop.wait()
        logger.info("stopping: readiness NOT_SERVING, %g s for the requests in flight", args.drain_timeout)
        await health.enter_graceful_shutdown()
        _exit_if_stuck(args.drain_timeout + STOP_HANG_S)
        await server.stop(args.drain_timeout)
        await health_server.stop(0)
        http.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await http_task
    return 0


def _exit_if_stuck(after_s: float) -> None:
    """grpcio's server.stop() has been seen to hang when a peer closed a stream at the same moment; a picker
    that cannot stop must not outlive its grace period either."""
    def watchdog() -> None:
        logger.error("shutdown did not finish within %.0f s; exiting", after_s)
        os._exit(0)

    timer = threading.Timer(after_s, watchdog)
    timer.daemon = True
    timer.start()
