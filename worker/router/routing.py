"""The routing core, assembled once for each program that routes: the router (`disagg router`), the gateway's
endpoint picker (`disagg epp`) and the decode side's prefill hop (`disagg worker`, `disagg pd-proxy`).

Each gets the same parts from the same flags: the two pools (endpoints.py) from a discovery (static URLs, a file
another process rewrites, or Kubernetes pods), the probes that keep them current (probes.py), the routing policy
(policies.py) and, for a policy that reads prefixes, the KV-event subscriptions and tokenizer (prefix_router.py).
`running()` starts the background tasks (probes, discovery, KV events), supervised (supervision.py), with two
HTTP clients - one for the hops, one of its own for the probes and /metrics scrapes, so that a full hop pool never
delays a probe (and so never makes a busy worker look hung) - and stops them.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import logging
import signal
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import uvicorn

from disagg.worker.listener import BatchAcceptServer
from disagg.worker.router.draining import CUT_GRACE_S, DRAIN_DELAY_S, DRAIN_TIMEOUT_S, Drain
from disagg.worker.router.endpoints import UNRESPONSIVE_AFTER_S, EndpointPool
from disagg.worker.router.hold import HoldQueue, HoldSettings
from disagg.worker.router.metrics import RouterMetrics
from disagg.worker.router.outliers import OutlierPolicy
from disagg.worker.router.policies import DEFAULT_POLICY, POLICY_NAMES, PolicySettings, make_policy
from disagg.worker.router.policy import RoutingPolicy
from disagg.worker.router.prefix_policy import PrefixPolicyConfig
from disagg.worker.router.state import RouterState
from disagg.worker.router.supervision import Supervisor
from disagg.worker.router.timeouts import HopTimeouts
from disagg.worker.router.waiting_room import DEFAULT_MAX_QUEUED, DEFAULT_QUEUE_WAIT_S

logger = logging.getLogger(__name__)

# Workers' HTTP servers (uvicorn, ours and vLLM's) close a connection left idle for 5 s. A request written to a
# pooled connection just as the worker closes it is reset unanswered - httpx's default keep-alive expiry is also
# 5 s, and a CI run's decode hop failed that way (ReadError; with no other decode left, the client got a 503).
# The router drops idle connections well before any worker would (uvicorn's timeout_keep_alive default, which
# vLLM's VLLM_HTTP_TIMEOUT_KEEP_ALIVE keeps).
KEEPALIVE_EXPIRY_S = 2.0
# The same race on the router's own listener: its clients (the OpenAI SDKs' httpx pools: 5 s; Envoy, load
# balancers: a minute or more) keep idle connections at least as long as uvicorn's 5 s, so the router closing first
# reset requests written meanwhile (bench/overload.py saw ReadErrors under a flood). Past what common clients keep
# (75 s, nginx's default), the client is the one that closes.
LISTENER_KEEP_ALIVE_S = 75
HOP_CONNECTIONS = 1000  # the hops' pool: past it a request waits the connect bound for one, then gets a 503
# Idle connections the hops' pool keeps. httpcore's pool walks every connection it holds at each request and
# release, and asks each idle one's socket whether the peer closed it (a poll per connection): with 100 kept,
# that walk was a third of the router's CPU under a flood (py-spy), and bench/overload.py at 2x / 10x capacity
# (2 cores, same session) served 41 / 19 req/s within the SLO; with 20, 83 / 52.
HOP_KEEPALIVE = 20
# Generation requests the router serves at once, in all (the per-worker bound: waiting_room.py): past half the
# hops' connections requests would queue in httpcore's pool, whose every request and release walks that queue
# against each connection - at 10x of 77 req/s with no bound the walk took 91% of the router's CPU (py-spy) and
# it served 1 req/s.
IN_FLIGHT_CEILING = HOP_CONNECTIONS // 2
PROBE_CONNECTIONS = 64  # the probes' and scrapes' own pool


class GracefulServer(BatchAcceptServer):
    """uvicorn that drains at SIGTERM/SIGINT (draining.py: /ready 503 at once, the listener closed after
    `drain_delay_s`, open streams cut with an error event after `drain_timeout_s`; a second SIGINT forces it) and
    then exits 0 (plain uvicorn re-raises the signal). Give uvicorn's timeout_graceful_shutdown the drain timeout
    plus CUT_GRACE_S (`config_for`), so that the error events go out before it cancels what is left."""

    def __init__(self, config: uvicorn.Config, drain: Drain | None = None, drain_delay_s: float = 0.0,
                 drain_timeout_s: float = DRAIN_TIMEOUT_S):
        super().__init__(config)
        self.drain = drain or Drain()
        self.drain_delay_s, self.drain_timeout_s = drain_delay_s, drain_timeout_s
        self._close_at: float | None = None

    @property
    def draining(self) -> bool:
        return self.drain.draining

    def handle_exit(self, sig: int, frame: Any) -> None:
        if not self.drain.draining:
            logger.info("received %s: draining (/ready 503; the listener closes in %g s)", signal.Signals(sig).name,
                        self.drain_delay_s)
            self.drain.draining = True
            self._close_at = time.monotonic() + self.drain_delay_s
        elif sig == signal.SIGINT:  # a second Ctrl-C quits at once
            self.force_exit = self.should_exit = True

    async def on_tick(self, counter: int) -> bool:
        if self._close_at is not None and time.monotonic() >= self._close_at and not self.should_exit:
            logger.info("closing the listener; open requests get %g s", self.drain_timeout_s)
            self.should_exit = True
            self.drain.cut_after(self.drain_timeout_s)
        return await super().on_tick(counter)


def graceful_config(app: Any, drain_timeout_s: float, **kw: Any) -> uvicorn.Config:
    """uvicorn's config for a GracefulServer: its own bound on open connections past the drain timeout, and
    idle client connections kept longer than clients keep them (LISTENER_KEEP_ALIVE_S)."""
    return uvicorn.Config(app, timeout_graceful_shutdown=drain_timeout_s + CUT_GRACE_S, access_log=False,
                          timeout_keep_alive=LISTENER_KEEP_ALIVE_S, **kw)


def worker_client(api_key: str | None = None) -> httpx.AsyncClient:
    """The hops' client; with the workers' API key on every request (api_keys.py)."""
    from disagg.worker.api_keys import bearer

    limits = httpx.Limits(max_connections=HOP_CONNECTIONS, max_keepalive_connections=HOP_KEEPALIVE,
                          keepalive_expiry=KEEPALIVE_EXPIRY_S)
    return httpx.AsyncClient(limits=limits, headers=bearer(api_key) if api_key else None)


def probe_client(api_key: str | None = None) -> httpx.AsyncClient:
    """The probes' and scrapes' client: a pool of its own (each call sets its own timeout)."""
    from disagg.worker.api_keys import bearer

    limits = httpx.Limits(max_connections=PROBE_CONNECTIONS, max_keepalive_connections=PROBE_CONNECTIONS,
                          keepalive_expiry=KEEPALIVE_EXPIRY_S)
    return httpx.AsyncClient(limits=limits, headers=bearer(api_key) if api_key else None)


def add_discovery_arguments(p: argparse.ArgumentParser | Any) -> None:
    p.add_argument("--prefill", nargs="*", default=[], metavar="URL", help="prefill worker base URLs")
    p.add_argument("--decode", nargs="*", default=[], metavar="URL", help="decode worker base URLs")
    p.add_argument("--discovery", choices=["static", "file", "kubernetes"], default="static")
    p.add_argument("--endpoints-file", metavar="PATH", help='file discovery: JSON {"prefill": [urls], "decode": '
                   '[urls]}, re-read when it changes (checked every --probe-interval); replace it atomically')
    p.add_argument("--namespace", default="default", help="kubernetes discovery: the pods' namespace")
    p.add_argument("--prefill-selector", help="kubernetes discovery: label selector of prefill pods")
    p.add_argument("--decode-selector", help="kubernetes discovery: label selector of decode pods")
    p.add_argument("--worker-port", type=int, default=8000, help="kubernetes discovery: the workers' HTTP port")
    p.add_argument("--worker-api-key-file", metavar="PATH", help="the workers' API key (first line; or "
                   "$DISAGG_WORKER_API_KEY), sent to them as `Authorization: Bearer`; a client's key is never "
                   "passed on")


def add_routing_arguments(p: argparse.ArgumentParser) -> None:
    """Discovery, policy, probes, bounds and outlier detection: the flags every routing program shares."""
    add_discovery_arguments(p)
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
    x.add_argument("--prefix-load-cost-tokens", type=float, default=PrefixPolicyConfig.load_cost_tokens,
                   help="one request in flight at an endpoint weighs as much as this many prompt tokens it would "
                   "have to compute")
    x.add_argument("--prefix-skip-prefill-blocks", type=int,
                   default=PrefixPolicyConfig.skip_prefill_max_missing_blocks, help="send to decode alone when the "
                   "chosen decode endpoint misses at most this many full blocks of the prompt (0: only all)")
    p.add_argument("--probe-interval", type=float, default=1.0, help="seconds between /ready probes")
    # load shedding (router/capacity.py): a worker at capacity answers 429; with every one of a pool so
    p.add_argument("--queue-wait", type=float, default=DEFAULT_QUEUE_WAIT_S,
                   help="seconds a request waits for room when every worker of a pool is at capacity (answered "
                        "429), before it is answered 429 with Retry-After (0: at once)")
    p.add_argument("--max-queued-requests", type=int, default=DEFAULT_MAX_QUEUED,
                   help="requests that may wait so at once, per pool; more are answered 429 at once")
    # bounds (router/timeouts.py): a hop past one fails over, or the client gets a 504 (README: Reliability)
    p.add_argument("--connect-timeout", type=float, default=5.0, help="seconds to connect to a worker (and to wait "
                   "for a starting one when none is ready)")
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
    # holding requests while no decode endpoint is ready (router/hold.py; scale from zero)
    p.add_argument("--hold-seconds", type=float, default=0.0,
                   help="hold a request that finds no ready decode endpoint up to this long (a pool scaled to "
                        "zero, starting), then 503 with Retry-After (0: no hold - wait the connect bound, then 503)")
    p.add_argument("--max-held-requests", type=int, default=100,
                   help="requests held at once; one more gets 429 with Retry-After")
    # outlier detection (router/outliers.py)
    p.add_argument("--eject-after-failures", type=int, default=2,
                   help="failed hops in a row that eject a worker endpoint (a timed-out hop ejects at once)")
    p.add_argument("--ejection-seconds", type=float, default=5.0,
                   help="first ejection's length; each further one in a row doubles it")
    p.add_argument("--max-ejection-seconds", type=float, default=300.0)


def routing_policy(args: argparse.Namespace) -> RoutingPolicy:
    """The --policy, with its tunables from the flags (ValueError naming a bad one)."""
    prefix = functools.partial(PrefixPolicyConfig, load_cost_tokens=args.prefix_load_cost_tokens,
                               skip_prefill_max_missing_blocks=args.prefix_skip_prefill_blocks)
    return make_policy(args.policy, PolicySettings(prefix=prefix))


@dataclass
class Routing:
    """What a routing program runs: the state its hops and picks read, and where its membership comes from."""
    state: RouterState
    discovery: Any  # FileDiscovery | KubernetesDiscovery | None (static URLs)
    args: argparse.Namespace
    worker_api_key: str | None = None  # sent to the workers on every call (api_keys.py), when they need one

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[RouterState]:
        """The probes, the discovery and the KV-event subscriptions run while inside; one client for all."""
        from disagg.worker.router.discovery import FileDiscovery
        from disagg.worker.router.probes import probe_forever

        state, args, discovery = self.state, self.args, self.discovery
        async with worker_client(self.worker_api_key) as client, probe_client(self.worker_api_key) as probes:
            state.client, state.probe_client = client, probes
            supervisor = Supervisor(state.metrics, state.down)
            supervisor.start("probes", lambda: probe_forever(state))
            if discovery is not None:
                supervisor.start("discovery", lambda: discovery.run(state.prefill, state.decode))
            if state.prefix is not None:
                from disagg.worker.kv_events.subscriber import EventsDirectory
                from disagg.worker.router.prefix_router import maintain_forever

                announced = (lambda url: discovery.kv_events.get(url)) \
                    if isinstance(discovery, FileDiscovery) else None
                directory = EventsDirectory(args.kv_events_port, args.kv_events_replay_port, args.kv_events_topic,
                                            announced)
                supervisor.start("kv_events", lambda: maintain_forever(
                    state.prefix, [state.prefill, state.decode], probes, args.probe_interval, directory))
            try:
                yield state
            finally:
                await supervisor.stop()


def prefill_routing(discovery: str, prefill: list[str], *, endpoints_file: str | None = None,
                    namespace: str = "default", selector: str | None = None, worker_port: int = 8000,
                    probe_interval_s: float = 1.0, decode_url: str | None = None, metrics_role: str = "decode",
                    bounds: list[str] = (), worker_api_key: str | None = None) -> Routing:
    """A decode side's routing (our worker's, pd-proxy's): the prefill pool it may call, from its discovery, and
    `decode_url` (the engine behind it, if it reaches it over HTTP) as the decode pool; `worker_api_key`: what
    the prefill workers want (the pool's shared key)."""
    p = argparse.ArgumentParser(add_help=False)
    add_routing_arguments(p)
    args = p.parse_args(["--discovery", discovery, "--probe-interval", str(probe_interval_s),
                         "--namespace", namespace, "--worker-port", str(worker_port), *bounds])
    args.prefill, args.decode = list(prefill), [decode_url] if decode_url else []
    args.endpoints_file, args.prefill_selector = endpoints_file, selector
    routing = build_routing(args, metrics_role=metrics_role, need_decode=False)
    routing.worker_api_key = worker_api_key or routing.worker_api_key
    return routing


def build_routing(args: argparse.Namespace, metrics_role: str = "router", need_decode: bool = True,
                  early_first_token: bool = True) -> Routing:
    """The pools, policy, bounds and discovery the flags describe; ValueError naming what is wrong.
    need_decode False: a decode side's hop - discovery keeps only the prefill pool (the decode pool is the
    engine behind it, given as --decode)."""
    from disagg.worker.api_keys import worker_key
    from disagg.worker.router.discovery import FileDiscovery, KubernetesDiscovery
    from disagg.worker.router.probes import probe_not_ready

    timeouts = HopTimeouts(args.connect_timeout, args.first_byte_timeout, args.idle_timeout, args.request_timeout)
    ejection = OutlierPolicy(args.eject_after_failures, args.ejection_seconds, args.max_ejection_seconds)
    hold = HoldSettings(args.hold_seconds, args.max_held_requests)
    problems = timeouts.problems() + ejection.problems() + hold.problems()
    if args.unresponsive_after < 0:
        problems.append(f"--unresponsive-after must be >= 0 seconds, got {args.unresponsive_after}")
    if args.queue_wait < 0:
        problems.append(f"--queue-wait must be >= 0 seconds, got {args.queue_wait}")
    if args.max_queued_requests < 0:
        problems.append(f"--max-queued-requests must be >= 0, got {args.max_queued_requests}")
    if problems:
        raise ValueError("; ".join(problems))
    discovery: Any = None
    if args.discovery == "kubernetes":
        if not args.prefill_selector or (need_decode and not args.decode_selector):
            raise ValueError("--discovery kubernetes needs --prefill-selector" +
                             (" and --decode-selector" if need_decode else ""))
        discovery = KubernetesDiscovery(args.namespace, args.prefill_selector, args.decode_selector,
                                        args.worker_port)
    elif args.discovery == "file":
        if not args.endpoints_file:
            raise ValueError("--discovery file needs --endpoints-file")
        discovery = FileDiscovery(args.endpoints_file, args.probe_interval)
    if discovery is not None and not need_decode:
        discovery.roles = ("prefill",)  # the decode pool is this process's own engine
    elif discovery is None and need_decode and not args.decode:
        raise ValueError("give at least one --decode URL (or --discovery file or kubernetes)")
    metrics = RouterMetrics(role=metrics_role)
    policy = routing_policy(args)
    prefix = None
    if policy.reads_prefixes:
        from disagg.worker.model.tokenizer import Tokenizer
        from disagg.worker.router.prefix_router import PrefixRouter

        prefix = PrefixRouter(policy, metrics, Tokenizer(args.tokenizer) if args.tokenizer else None)
    # a decode side's decode "pool" is its own engine: nowhere else to send, so no hop takes it out (EndpointPool)
    prefill, decode = (EndpointPool(role, policy, outlier_policy=ejection, unresponsive_after_s=args.unresponsive_after,
                                    judged_by_hops=need_decode or role == "prefill")
                       for role in ("prefill", "decode"))
    prefill.set_urls(args.prefill)
    decode.set_urls(args.decode)
    if isinstance(discovery, FileDiscovery):
        discovery.poll(prefill, decode)  # the first membership before serving
    state = RouterState(prefill, decode, metrics, probe_interval_s=args.probe_interval, timeouts=timeouts,
                        prefix=prefix, early_first_token=early_first_token, queue_wait_s=args.queue_wait,
                        max_queued=args.max_queued_requests,
                        max_in_flight_per_endpoint=getattr(args, "max_in_flight_per_endpoint", 0),  # the router's
                        in_flight_ceiling=IN_FLIGHT_CEILING)
    metrics.watch_handoffs(state.handoffs, state.members)
    metrics.watch_queues(lambda: {role: room.waiting for role, room in state.rooms.items()})
    if hold.enabled:
        state.hold = HoldQueue(hold, functools.partial(probe_not_ready, state))
        metrics.watch_held(lambda: state.hold.held)
    return Routing(state, discovery, args, worker_key(getattr(args, "worker_api_key_file", None)))
