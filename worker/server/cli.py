"""`disagg worker`: one engine behind the OpenAI-compatible HTTP API, as prefill, decode or both.

SIGTERM/SIGINT drain: /ready turns 503 and the listener closes, running requests finish, KV blocks held
for a remote reader are kept until pulled (at most the lease), then the process exits 0.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import signal
import time
from types import FrameType
from typing import Any

import uvicorn

from disagg.worker.kv_transfer.nixl import DEFAULT_LEASE_SECONDS

KV_ROLES = {"prefill": "kv_producer", "decode": "kv_consumer", "both": "kv_both"}

logger = logging.getLogger("disagg.worker.server")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--role", choices=sorted(KV_ROLES), default="both",
                   help="prefill: computes prompts and hands off KV; decode: pulls KV and generates; both: colocated")
    p.add_argument("--model", help="checkpoint directory; omitted: the generated tiny demo checkpoint")
    p.add_argument("--served-model-name", help="model name in the API (default: the directory name)")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=8000)
    g = p.add_argument_group("engine")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--device", default="auto")
    g.add_argument("--max-model-len", type=int)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--num-kv-blocks", type=int, help="KV blocks (default: from --kv-cache-memory-bytes)")
    g.add_argument("--kv-cache-memory-bytes", type=int, help="KV-cache budget (CPU default 1 GiB)")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--seed", type=int, default=0)
    k = p.add_argument_group("KV transfer")
    k.add_argument("--kv-connector", help="NixlConnector, SharedStorageConnector or 'package.module:Class'")
    k.add_argument("--kv-connector-extra-config", default="{}", help="JSON object passed to the connector")
    k.add_argument("--kv-role", choices=sorted(KV_ROLES.values()), help="default: from --role")
    k.add_argument("--kv-load-failure-policy", choices=["recompute", "fail"], default="recompute")
    k.add_argument("--kv-lease-seconds", type=int, help="prefill frees KV not pulled within this time "
                   f"(default {DEFAULT_LEASE_SECONDS}); also bounds the drain wait")
    k.add_argument("--kv-side-channel-host", help="NIXL side channel address advertised to decode workers")
    k.add_argument("--kv-side-channel-port", type=int, help="NIXL side channel port")
    k.add_argument("--kv-shared-storage-path", help="SharedStorageConnector directory")
    k.add_argument("--engine-id", default="", help="unique engine id (default: random)")
    p.add_argument("--drain-timeout", type=float, default=120.0,
                   help="seconds to wait for running requests after SIGTERM")
    p.add_argument("--log-level", default="INFO")


def kv_transfer_config(args: argparse.Namespace) -> Any:
    from disagg.worker.kv_transfer.base import KVTransferConfig

    try:
        extra = json.loads(args.kv_connector_extra_config)
    except json.JSONDecodeError as e:
        raise ValueError(f"--kv-connector-extra-config is not JSON: {e}") from None
    if not isinstance(extra, dict):
        raise ValueError(f"--kv-connector-extra-config must be a JSON object, got {extra!r}")
    for key, value in (("lease_seconds", args.kv_lease_seconds), ("side_channel_host", args.kv_side_channel_host),
                       ("side_channel_port", args.kv_side_channel_port),
                       ("shared_storage_path", args.kv_shared_storage_path)):
        if value is not None:
            extra[key] = value
    return KVTransferConfig(
        kv_connector=args.kv_connector,  # a registered name or 'package.module:Class' (the factory resolves both)
        kv_role=args.kv_role or KV_ROLES[args.role], engine_id=args.engine_id,
        kv_load_failure_policy=args.kv_load_failure_policy, kv_connector_extra_config=extra,
    )


def engine_config(args: argparse.Namespace, model: str) -> Any:
    from disagg.worker.engine.config import EngineConfig

    return EngineConfig(
        model=model, served_model_name=args.served_model_name, dtype=args.dtype, device=args.device,
        block_size=args.block_size, num_kv_blocks=args.num_kv_blocks,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes, gpu_memory_utilization=args.gpu_memory_utilization,
        max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=not args.no_prefix_caching,
        seed=args.seed, kv_transfer_config=kv_transfer_config(args),
    )


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from disagg.worker.model.tiny import default_model_dir
    from disagg.worker.engine.llm_engine import LLMEngine
    from disagg.worker.server.metrics import WorkerMetrics
    from disagg.worker.server.app import ServerState, build_app
    from disagg.worker.server.engine_loop import EngineLoop

    model = args.model or str(default_model_dir())
    try:
        config = engine_config(args, model)
    except ValueError as e:
        logger.error("%s", e)
        return 2
    lease = float(config.kv_transfer_config.kv_connector_extra_config.get("lease_seconds", DEFAULT_LEASE_SECONDS))
    engine_loop = EngineLoop(lambda: LLMEngine(config),
                             lambda engine: WorkerMetrics(engine.served_model_name, args.role))
    state = ServerState(engine_loop, args.role)
    app = build_app(state)
    server = DrainingServer(
        uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level.lower(),
                       timeout_graceful_shutdown=args.drain_timeout, access_log=False),
        state,
    )
    app.router.lifespan_context = _lifespan(server, engine_loop, lease)
    server.run()
    if engine_loop.load_error:
        logger.error("%s", engine_loop.load_error)
        return 1
    return 0 if server.started else 1


class DrainingServer(uvicorn.Server):
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


def _lifespan(server: Any, engine_loop: Any, lease_s: float) -> Any:
    @contextlib.asynccontextmanager
    async def lifespan(_app: Any) -> Any:
        engine_loop.start(asyncio.get_running_loop())
        watcher = asyncio.ensure_future(_exit_if_load_fails(server, engine_loop))
        yield
        watcher.cancel()
        # HTTP is drained (uvicorn waited for open responses); KV blocks may still wait for remote readers
        deadline = time.monotonic() + lease_s
        if engine_loop.ready and not engine_loop.idle():
            logger.info("waiting up to %.0fs for pending KV transfers", lease_s)
        while engine_loop.ready and not engine_loop.idle() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await asyncio.to_thread(engine_loop.stop)
        logger.info("stopped")

    return lifespan


async def _exit_if_load_fails(server: Any, engine_loop: Any) -> None:
    while not engine_loop.loaded.is_set():
        await asyncio.sleep(0.1)
    if engine_loop.load_error:
        server.should_exit = True
    else:
        logger.info("engine loaded: model=%s ready", engine_loop.engine.served_model_name)
