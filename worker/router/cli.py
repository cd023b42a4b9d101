"""`disagg router`: the P/D proxy in front of prefill and decode workers (static URLs, a JSON endpoints file
rewritten at run time, or Kubernetes pods)."""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import logging
import signal
from types import FrameType
from typing import Any

import httpx
import uvicorn

from disagg.worker.router.endpoints import UNRESPONSIVE_AFTER_S, EndpointPool
from disagg.worker.router.policies import DEFAULT_POLICY, POLICY_NAMES, PolicySettings, make_policy
from disagg.worker.router.policy import RoutingPolicy
from disagg.worker.router.prefix_policy import PrefixPolicyConfig

logger = logging.getLogger("disagg.worker.router")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefill", nargs="*", default=[], metavar="URL", help="prefill worker base URLs")
    p.add_argument("--decode", nargs="*", default=[], metavar="URL", help="decode worker base URLs")
    p.add_argument("--discovery", choices=["static", "file", "kubernetes"], default="static")
    p.add_argument("--endpoints-file", metavar="PATH", help='file discovery: JSON {"prefill": [urls], "decode": '
                   '[urls]}, re-read when it changes (checked every --probe-interval); replace it atomically')
    p.add_argument("--namespace", default="default", help="kubernetes discovery: the pods' namespace")
    p.add_argument("--prefill-selector", help="kubernetes discovery: label selector of prefill pods")
    p.add_argument("--decode-selector", help="kubernetes discovery: label selector of decode pods")
    p.add_argument("--worker-port", type=int, default=8000, help="kubernetes discovery: the workers' HTTP port")
    p.add_argument("--policy", choices=POLICY_NAMES, default=DEFAULT_POLICY,
                   help="prefix-aware: by the workers' KV-cache events (their --kv-events-endpoint), the endpoint "
                   "holding the longest prefix of the prompt, weighed against load")
    x = p.add_argument_group("prefix-aware policy")
    x.add_argument("--tokenizer", metavar="DIR", help="the served model's tokenizer directory (default: fetched "
                   "from a worker's GET /tokenizer)")
    x.add_argument("--kv-events-port", type=int, help="where workers that serve no GET /kv_events (vLLM) publish "
                   "KV-cache events: this port at each endpoint URL's host (the endpoints file's \"kv_events\" "
                   "entries come first)")
    x.add_argument("--kv-events-replay-port", type=int, help="their replay socket's port")
    x.add_argument("--kv-events-topic", default="", help="their events' topic frame")
    x.add_argument("--prefix-load-cost-tokens", type=float, default=PrefixPolicyConfig.load_cost_tokens, help="one request in flight at an "
                   "endpoint weighs as much as this many prompt tokens it would have to compute")
    x.add_argument("--prefix-skip-prefill-blocks", type=int,
                   default=PrefixPolicyConfig.skip_prefill_max_missing_blocks, help="send to decode alone when the "
                   "chosen decode endpoint misses at most this many full blocks of the prompt (0: only all)")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--probe-interval", type=float, default=1.0, help="seconds between /ready probes")
    p.add_argument("--no-early-first-token", dest="early_first_token", action="store_false",
                   help="stream a P/D request's first token from the decode worker, not from the prefill's answer "
                        "(a decode hop that fails is then a 5xx status, not an SSE error event after that token)")
    # bounds (router/timeouts.py): a hop past one fails over, or the client gets a 504 (README: Reliability)
    p.add_argument("--connect-timeout", type=float, default=5.0, help="seconds to connect to a worker")
    p.add_argument("--first-byte-timeout", type=float, default=120.0,
                   help="seconds from sending a hop to its first byte (the prefill's answer, a decode stream's "
                        "first chunk); a hung worker is left for another one after this")
    p.add_argument("--idle-timeout", type=float, default=60.0,
                   help="seconds a decode stream may be silent between chunks")
    p.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds per client request, all hops together (bounds a non-streamed decode too)")
    p.add_argument("--unresponsive-after", type=float, default=UNRESPONSIVE_AFTER_S,
                   help="seconds of readiness probes timing out in a row after which a worker counts as hung: "
                        "it is taken out and the waits on it that streamed nothing yet fail over (0: never; the "
                        "bounds above still hold)")
    # outlier detection (router/outliers.py)
    p.add_argument("--eject-after-failures", type=int, default=2,
                   help="failed hops in a row that eject a worker endpoint (a timed-out hop ejects at once)")
    p.add_argument("--ejection-seconds", type=float, default=5.0,
                   help="first ejection's length; each further one in a row doubles it")
    p.add_argument("--max-ejection-seconds", type=float, default=300.0)
    p.add_argument("--drain-timeout", type=float, default=120.0,
                   help="seconds to wait for open requests after SIGTERM")
    p.add_argument("--log-level", default="INFO")


def routing_policy(args: argparse.Namespace) -> RoutingPolicy:
    """The --policy, with its tunables from the flags (ValueError naming a bad one)."""
    prefix = functools.partial(PrefixPolicyConfig, load_cost_tokens=args.prefix_load_cost_tokens,
                               skip_prefill_max_missing_blocks=args.prefix_skip_prefill_blocks)
    return make_policy(args.policy, PolicySettings(prefix=prefix))


def _prefix_router(args: argparse.Namespace, policy: RoutingPolicy, metrics: Any) -> Any:
    if not policy.reads_prefixes:
        return None
    from disagg.worker.model.tokenizer import Tokenizer
    from disagg.worker.router.prefix_router import PrefixRouter

    return PrefixRouter(policy, metrics, Tokenizer(args.tokenizer) if args.tokenizer else None)


class _Server(uvicorn.Server):
    """Exit 0 after a signal-initiated graceful shutdown (uvicorn would re-raise the signal)."""

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if not self.should_exit:
            logger.info("received %s: draining", signal.Signals(sig).name)
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        self.should_exit = True


# Workers' HTTP servers (uvicorn, ours and vLLM's) close a connection left idle for 5 s. A request written to a
# pooled connection just as the worker closes it is reset unanswered - httpx's default keep-alive expiry is also
# 5 s, and a CI run's decode hop failed that way (ReadError; with no other decode left, the client got a 503).
# The router drops idle connections well before any worker would (uvicorn's timeout_keep_alive default, which
# vLLM's VLLM_HTTP_TIMEOUT_KEEP_ALIVE keeps).
KEEPALIVE_EXPIRY_S = 2.0


def worker_client() -> httpx.AsyncClient:
    """The router's one client for every hop, probe and scrape."""
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=100, keepalive_expiry=KEEPALIVE_EXPIRY_S)
    return httpx.AsyncClient(limits=limits)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per probe otherwise
    from disagg.worker.router.app import build_app
    from disagg.worker.router.discovery import FileDiscovery, KubernetesDiscovery
    from disagg.worker.router.metrics import RouterMetrics
    from disagg.worker.router.outliers import OutlierPolicy
    from disagg.worker.router.probes import probe_forever
    from disagg.worker.router.state import RouterState
    from disagg.worker.router.timeouts import HopTimeouts

    timeouts = HopTimeouts(args.connect_timeout, args.first_byte_timeout, args.idle_timeout, args.request_timeout)
    ejection = OutlierPolicy(args.eject_after_failures, args.ejection_seconds, args.max_ejection_seconds)
    for problem in timeouts.problems() + ejection.problems():
        logger.error("%s", problem)
    if timeouts.problems() or ejection.problems():
        return 2
    if args.unresponsive_after < 0:
        logger.error("--unresponsive-after must be >= 0 seconds, got %s", args.unresponsive_after)
        return 2

    discovery = None
    if args.discovery == "kubernetes":
        if not args.prefill_selector or not args.decode_selector:
            logger.error("--discovery kubernetes needs --prefill-selector and --decode-selector")
            return 2
        discovery = KubernetesDiscovery(args.namespace, args.prefill_selector, args.decode_selector,
                                        args.worker_port)
    elif args.discovery == "file":
        if not args.endpoints_file:
            logger.error("--discovery file needs --endpoints-file")
            return 2
        discovery = FileDiscovery(args.endpoints_file, args.probe_interval)
    elif not args.decode:
        logger.error("give at least one --decode URL (or --discovery file or kubernetes)")
        return 2
    metrics = RouterMetrics()
    try:
        policy = routing_policy(args)
        prefix = _prefix_router(args, policy, metrics)
    except (ValueError, FileNotFoundError) as e:
        logger.error("%s", e)
        return 2
    prefill, decode = (EndpointPool(role, policy, outlier_policy=ejection,
                                    unresponsive_after_s=args.unresponsive_after) for role in ("prefill", "decode"))
    prefill.set_urls(args.prefill)
    decode.set_urls(args.decode)
    if isinstance(discovery, FileDiscovery):
        discovery.poll(prefill, decode)  # the first membership before serving
    state = RouterState(prefill, decode, metrics, probe_interval_s=args.probe_interval, timeouts=timeouts,
                        prefix=prefix, early_first_token=args.early_first_token)
    app = build_app(state)

    @contextlib.asynccontextmanager
    async def lifespan(_app: Any) -> Any:
        async with worker_client() as client:
            state.client = client
            tasks = [asyncio.ensure_future(probe_forever(state))]
            if discovery is not None:
                tasks.append(asyncio.ensure_future(discovery.run(prefill, decode)))
            if prefix is not None:
                from disagg.worker.kv_events.subscriber import EventsDirectory
                from disagg.worker.router.prefix_router import maintain_forever

                announced = (lambda url: discovery.kv_events.get(url)) \
                    if isinstance(discovery, FileDiscovery) else None
                directory = EventsDirectory(args.kv_events_port, args.kv_events_replay_port, args.kv_events_topic,
                                            announced)
                tasks.append(asyncio.ensure_future(maintain_forever(prefix, [prefill, decode], client,
                                                                    args.probe_interval, directory)))
            logger.info("routing: prefill=%s decode=%s policy=%s", list(prefill.endpoints), list(decode.endpoints),
                        args.policy)
            yield
            for t in tasks:
                t.cancel()

    app.router.lifespan_context = lifespan
    server = _Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level.lower(),
                                    timeout_graceful_shutdown=args.drain_timeout, access_log=False))
    server.run()
    return 0 if server.started else 1
