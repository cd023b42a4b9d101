"""`disagg worker`: one engine behind the OpenAI-compatible HTTP API, as prefill, decode or both.

SIGTERM/SIGINT drain: /ready turns 503 and the listener closes, running requests finish, KV blocks held
for a remote reader are kept until pulled (at most the lease), then the process exits 0.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import time
from types import FrameType
from typing import Any

import uvicorn

from disagg.worker.api_keys import ApiKeys, RequireApiKey, worker_own_keys
from disagg.worker.listener import BatchAcceptServer
from disagg.worker.kv_transfer.connectors import DEFAULT_LEASE_SECONDS
from disagg.worker.server.args import add_arguments, kv_transfer_config  # noqa: F401  (the subcommand's parser)

logger = logging.getLogger("disagg.worker.server")


def handoff_signer() -> Any:
    """The hand-off key of this resource ($DISAGG_HANDOFF_KEY or _FILE, $DISAGG_HANDOFF_RESOURCE), or None - said
    loudly: then anyone who reaches this worker can make it connect to any host and read any prefill's KV."""
    from disagg.worker.kv_transfer.handoff_auth import KEY_ENV, signer_from_env

    signer = signer_from_env()
    if signer is None:
        logger.warning("no hand-off key ($%s): P/D hand-offs are neither signed nor checked and the KV side "
                       "channel is open; run only on a network no one else reaches (the operator and `disagg up` "
                       "always set one)", KEY_ENV)
    else:
        logger.info("hand-offs signed and checked for %s", signer.resource)
    return signer


def engine_config(args: argparse.Namespace, model: str, signer: Any = None) -> Any:
    from disagg.worker.config import EngineConfig

    transfer = kv_transfer_config(args)
    transfer.auth = signer
    return EngineConfig(
        model=model, served_model_name=args.served_model_name, dtype=args.dtype, device=args.device,
        block_size=args.block_size, num_kv_blocks=args.num_kv_blocks,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes, gpu_memory_utilization=args.gpu_memory_utilization,
        max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=not args.no_prefix_caching,
        seed=args.seed, kv_transfer_config=transfer, enable_kv_events=bool(args.kv_events_endpoint),
    )


def kv_events_publisher(args: argparse.Namespace) -> Any:
    """The ZMQ publisher when --kv-events-endpoint is given, else None; ValueError on a bad or busy address."""
    if not args.kv_events_endpoint:
        return None
    from disagg.worker.kv_events.publisher import ZmqEventPublisher, bind_endpoint, replay_endpoint_for

    endpoint = bind_endpoint(args.kv_events_endpoint, args.host)
    replay = args.kv_events_replay_endpoint or replay_endpoint_for(endpoint)
    return ZmqEventPublisher(endpoint, replay, args.block_size, topic=args.kv_events_topic)


def exposure_warnings(args: argparse.Namespace) -> list[str]:
    """What this worker's command line opens to every interface that carries more than a probe: the KV-event
    sockets (BlockStored carries the token ids of every cached prompt block) and the NIXL side channel."""
    from disagg.worker.kv_events.publisher import WILDCARD_HOSTS, binds_every_interface

    out = []
    for flag, endpoint in (("--kv-events-endpoint", args.kv_events_endpoint),
                           ("--kv-events-replay-endpoint", args.kv_events_replay_endpoint)):
        if endpoint and binds_every_interface(endpoint):
            out.append(f"{flag} {endpoint} binds every interface: whoever connects reads the token ids of every "
                       "prompt block this worker caches (its prompts); bind the pod's address instead")
    if getattr(args, "side_channel_host", None) in WILDCARD_HOSTS:
        out.append(f"--kv-side-channel-host {args.side_channel_host} binds every interface: without a hand-off key "
                   "whoever connects gets this engine's NIXL metadata and can READ its KV cache")
    return out


def prefill_hop_routing(args: argparse.Namespace, api_key: str | None = None) -> Any:
    """The prefill pool behind a gateway (--pd-*), or None: the decode side's hop is off. `api_key`: the pool's
    shared key, sent to the prefill workers."""
    if args.pd_discovery == "none":
        return None
    if args.role == "prefill":
        raise ValueError("--pd-discovery is for a decode (or both) worker: a prefill worker runs no prefill hop")
    from disagg.worker.router.routing import prefill_routing

    return prefill_routing(args.pd_discovery, args.pd_prefill, endpoints_file=args.pd_endpoints_file,
                           namespace=args.pd_namespace, selector=args.pd_prefill_selector,
                           worker_port=args.pd_worker_port, probe_interval_s=args.pd_probe_interval,
                           worker_api_key=api_key)


def admission_limits(args: argparse.Namespace) -> Any:
    """The waiting queue's bounds from the flags (defaults from the batch limits); ValueError naming a bad one."""
    from disagg.worker.server.admission import AdmissionLimits

    for flag, value in (("--max-waiting-requests", args.max_waiting_requests),
                        ("--max-waiting-prompt-tokens", args.max_waiting_prompt_tokens)):
        if value is not None and value < 0:
            raise ValueError(f"{flag} must be >= 0, got {value}")
    from disagg.worker.body_limit import body_limit_problems

    if problems := body_limit_problems(args):
        raise ValueError("; ".join(problems))
    return AdmissionLimits.of(args.max_num_seqs, args.max_num_batched_tokens, args.max_waiting_requests,
                              args.max_waiting_prompt_tokens, role=args.role)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from disagg.worker.model.tiny import default_model_dir

    model = args.model or str(default_model_dir())
    for warning in exposure_warnings(args):
        logger.warning("%s", warning)
    api_keys = worker_own_keys(args.api_key)
    if args.cpu_threads < 0:
        logger.error("--cpu-threads must be >= 0 (0: automatic), got %d", args.cpu_threads)
        return 2
    from disagg.worker.cores import set_cpu_threads

    set_cpu_threads(args.cpu_threads)
    try:
        signer = handoff_signer()
        config = engine_config(args, model, signer)
        pd = prefill_hop_routing(args, api_keys[0] if api_keys else None)
        keys = ApiKeys.of(api_keys) if api_keys else None
        publisher = kv_events_publisher(args)
        limits = admission_limits(args)
    except (ValueError, OSError) as e:
        logger.error("%s", e)
        return 2
    try:
        return _serve(args, config, publisher, pd, signer, keys, limits)
    finally:
        if publisher is not None:  # after the engine stopped: its last changes are sent
            publisher.close()


def _serve(args: argparse.Namespace, config: Any, publisher: Any, pd: Any, signer: Any, keys: Any,
           limits: Any) -> int:
    from disagg.worker.engine.llm_engine import LLMEngine
    from disagg.worker.server.metrics import worker_metrics
    from disagg.worker.server.app import ServerState, build_app
    from disagg.worker.server.engine_loop import EngineLoop

    lease = float(config.kv_transfer_config.kv_connector_extra_config.get("lease_seconds", DEFAULT_LEASE_SECONDS))
    engine_loop = EngineLoop(lambda: LLMEngine(config), lambda engine: worker_metrics(engine, args.role),
                             publish_kv_events=publisher.publish if publisher is not None else None, limits=limits)
    state = ServerState(engine_loop, args.role, kv_events=publisher.info if publisher is not None else None,
                        pd=pd.state if pd is not None else None, early_first_token=args.early_first_token,
                        signer=signer, max_body_bytes=args.max_request_body_bytes,
                        body_timeout_s=args.request_body_timeout)
    app = build_app(state)
    if keys is not None:
        app.add_middleware(RequireApiKey, keys=keys)
    server = DrainingServer(
        uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level.lower(),
                       timeout_graceful_shutdown=args.drain_timeout, access_log=False),
        state,
    )
    app.router.lifespan_context = _lifespan(server, engine_loop, lease, pd, state.preparer)
    server.run()
    if engine_loop.load_error:
        logger.error("%s", engine_loop.load_error)
        return 1
    return 0 if server.started else 1


class DrainingServer(BatchAcceptServer):
    """uvicorn.Server that marks the worker draining on SIGTERM/SIGINT and exits 0 afterwards
    (uvicorn would re-raise the signal, turning a clean drain into exit status -15)."""

    def __init__(self, config: uvicorn.Config, state: Any):
        super().__init__(config)
        self.state = state

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if not self.state.draining:
            logger.info("received %s: draining", signal.Signals(sig).name)
        self.state.draining = True
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True  # a second Ctrl-C quits at once
        self.should_exit = True


def _lifespan(server: Any, engine_loop: Any, lease_s: float, pd: Any, preparer: Any) -> Any:
    @contextlib.asynccontextmanager
    async def lifespan(_app: Any) -> Any:
        engine_loop.start(asyncio.get_running_loop())
        watcher = asyncio.ensure_future(_exit_if_load_fails(server, engine_loop))
        async with (pd.running() if pd is not None else contextlib.nullcontext()):
            yield
        watcher.cancel()
        # HTTP is drained (uvicorn waited for open responses); KV blocks may still wait for remote readers
        deadline = time.monotonic() + lease_s
        if engine_loop.ready and not engine_loop.idle():
            logger.info("waiting up to %.0fs for pending KV transfers", lease_s)
        while engine_loop.ready and not engine_loop.idle() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await asyncio.to_thread(engine_loop.stop)
        preparer.shutdown()
        logger.info("stopped")

    return lifespan


async def _exit_if_load_fails(server: Any, engine_loop: Any) -> None:
    while not engine_loop.loaded.is_set():
        await asyncio.sleep(0.1)
    if engine_loop.load_error:
        server.should_exit = True
    else:
        logger.info("engine loaded: model=%s ready", engine_loop.engine.served_model_name)
