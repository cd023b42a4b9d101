"""`disagg worker`'s command line: the parser, and the KV-transfer config built from it.

Standard library only, so the operator (whose image has no torch, uvicorn or nixl) can parse every command it
generates with this same parser (`parse_worker_args`) and reject a spec whose pods would not start.
"""
from __future__ import annotations

import argparse
import json
from typing import Any

from disagg.worker.body_limit import add_body_arguments
from disagg.worker.kv_transfer.connectors import DEFAULT_LEASE_SECONDS, all_settings

KV_ROLES = {"prefill": "kv_producer", "decode": "kv_consumer", "both": "kv_both"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--role", choices=sorted(KV_ROLES), default="both",
                   help="prefill: computes prompts and hands off KV; decode: pulls KV and generates; both: colocated")
    p.add_argument("--model", help="checkpoint directory; omitted: the generated tiny demo checkpoint")
    p.add_argument("--served-model-name", help="model name in the API (default: the directory name)")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", nargs="+", metavar="KEY",
                   help="require `Authorization: Bearer <one of these>` on every route but /health, /ready and "
                        "/metrics (default: $VLLM_API_KEY, as vLLM; none: open); the decode side's prefill hop sends "
                        "the first")
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
    g.add_argument("--cpu-threads", type=int, default=0, metavar="N",
                   help="threads of the engine's CPU kernels (torch intra-op); 0: $OMP_NUM_THREADS when set, else "
                        "the cores this process may use - its affinity cut to its cgroup's CPU quota (`disagg up` "
                        "gives each worker its share of the machine)")
    a = p.add_argument_group("admission (past a bound: 429 with Retry-After, or 413)")
    a.add_argument("--max-waiting-requests", type=int, metavar="N",
                   help="requests queued beyond the running batch (default: --max-num-seqs; on a decode worker an "
                        "eighth of it)")
    a.add_argument("--max-waiting-prompt-tokens", type=int, metavar="N",
                   help="prompt tokens queued to compute here; a request alone is always queued (default: 8 x "
                        "--max-num-batched-tokens)")
    add_body_arguments(a)
    g.add_argument("--seed", type=int, default=0)
    k = p.add_argument_group("KV transfer")
    k.add_argument("--kv-connector", help="a connector's name (see kv_transfer/connectors.py) or "
                   "'package.module:Class'")
    k.add_argument("--kv-connector-extra-config", default="{}", help="JSON object passed to the connector")
    k.add_argument("--kv-role", choices=sorted(KV_ROLES.values()), help="default: from --role")
    k.add_argument("--kv-load-failure-policy", choices=["recompute", "fail"], default="recompute")
    k.add_argument("--kv-lease-seconds", type=int, help="prefill frees KV not pulled within this time "
                   f"(default {DEFAULT_LEASE_SECONDS}); also bounds the drain wait")
    for setting in all_settings():  # each connector's own settings, from its declaration
        k.add_argument(setting.flag, type=setting.value_type, dest=setting.extra_key, help=setting.help)
    k.add_argument("--engine-id", default="", help="unique engine id (default: random)")
    e = p.add_argument_group("KV-cache events (vLLM's ZMQ wire format; read by `disagg router --policy prefix-aware`)")
    e.add_argument("--kv-events-endpoint", metavar="tcp://HOST:PORT",
                   help="publish prefix-cache changes on this ZMQ PUB address, e.g. tcp://10.0.0.7:5557; "
                        "tcp://:5557 binds --host when that is one address, else loopback (default: off). The "
                        "events carry the token ids of cached prompt blocks: bind an address only the router reaches")
    e.add_argument("--kv-events-replay-endpoint", metavar="tcp://HOST:PORT",
                   help="ZMQ ROUTER address a subscriber asks to catch up (default: the PUB address, port + 1)")
    e.add_argument("--kv-events-topic", default="", help="topic frame of every event message")
    h = p.add_argument_group("P/D behind a gateway: the decode side's prefill hop (x-prefiller-host-port, set by "
                             "`disagg epp`) goes only to a prefill endpoint these name (default: none is taken)")
    h.add_argument("--pd-discovery", choices=["none", "static", "file", "kubernetes"], default="none")
    h.add_argument("--pd-prefill", nargs="*", default=[], metavar="URL", help="static: the prefill workers")
    h.add_argument("--pd-endpoints-file", metavar="PATH", help="file: the router's endpoints file (its prefill list)")
    h.add_argument("--pd-namespace", default="default", help="kubernetes: the prefill pods' namespace")
    h.add_argument("--pd-prefill-selector", help="kubernetes: the prefill pods' label selector")
    h.add_argument("--pd-worker-port", type=int, default=8000, help="kubernetes: the prefill pods' HTTP port")
    h.add_argument("--pd-probe-interval", type=float, default=1.0, help="seconds between the prefill probes")
    h.add_argument("--no-early-first-token", dest="early_first_token", action="store_false",
                   help="stream a gateway request's first token from this engine, not from the prefill's answer")
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
    if args.kv_lease_seconds is not None:
        extra["lease_seconds"] = args.kv_lease_seconds
    for setting in all_settings():
        value = getattr(args, setting.extra_key)
        if value is not None:
            extra[setting.extra_key] = value
    return KVTransferConfig(
        kv_connector=args.kv_connector,  # a declared name or 'package.module:Class' (the factory resolves both)
        kv_role=args.kv_role or KV_ROLES[args.role], engine_id=args.engine_id,
        kv_load_failure_policy=args.kv_load_failure_policy, kv_connector_extra_config=extra,
    )


class _RaisingParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise ValueError(message)


def parse_worker_args(argv: list[str]) -> argparse.Namespace:
    """Parse `disagg worker` arguments (without the leading "worker") as the worker would; ValueError names
    the flag it rejects instead of exiting."""
    parser = _RaisingParser(prog="disagg worker", add_help=False)
    add_arguments(parser)
    return parser.parse_args(argv)
