"""The one place a worker's command line is built from (spec, role, placement).

The operator's pod templates and `disagg up` both get it through plan.py; they differ only in the Placement
(placement.py): on Kubernetes fixed ports and the pod IP through the downward API, locally free ports on one host.
The model download (an init container on Kubernetes) is built here too. checks.command_problems() parses every
command a spec would produce with the worker's own parser, so `disagg validate` and the operator reject a spec
whose pods could not start.

Pure: no API calls, no processes. Standard library + the spec models only (the operator image has no torch).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from disagg.operator import spec as s
from disagg.operator.naming import KV_EVENTS_TOPIC
from disagg.operator.placement import Placement
from disagg.worker.kv_transfer.connectors import declaration_of

Role = Literal["prefill", "decode"]
ROLES: tuple[Role, ...] = ("prefill", "decode")
EXECUTABLE = "disagg"  # the image's entrypoint; `disagg up` runs the same CLI with its own interpreter
VLLM_EXECUTABLE = "vllm"  # engine vllm: on the engine image's PATH; `disagg up` takes a configured path


@dataclass(frozen=True)
class WorkerCommand:
    argv: list[str]  # argv[0] is EXECUTABLE
    env: dict[str, str] = field(default_factory=dict)  # variables the engine needs beyond the user's spec env


def build_worker_command(spec: s.DisaggregatedInferenceSpec, role: Role, placement: Placement) -> WorkerCommand:
    """The engine's command: `disagg worker ...` or `vllm serve ...`, then spec.engineArgs, then the role's
    extraArgs (last, so a user's flag wins where the engine lets a later flag override)."""
    build = _vllm_command if spec.engine == "vllm" else _disagg_command
    command = build(spec, role, placement)
    return WorkerCommand([*command.argv, *spec.engine_args, *getattr(spec, role).extra_args], command.env)


def _disagg_command(spec: s.DisaggregatedInferenceSpec, role: Role, placement: Placement) -> WorkerCommand:
    kv = spec.kv_transfer
    argv = [EXECUTABLE, "worker", "--role", role, "--model", placement.model_dir,
            "--served-model-name", spec.model.served_name,
            "--host", placement.host, "--port", str(placement.port), "--dtype", spec.model.dtype,
            "--kv-connector", kv.connector, "--kv-lease-seconds", str(kv.lease_seconds),
            "--kv-load-failure-policy", kv.load_failure_policy,
            # SIGTERM drain: running requests get this long, then unread KV waits up to the lease, all inside
            # terminationGracePeriodSeconds (after the preStop wait), so a removed worker loses no work
            "--drain-timeout", str(max(1, s.request_drain_seconds(spec, role)))]
    declaration = declaration_of(kv.connector)
    for setting in declaration.settings if declaration else ():
        value = getattr(placement, setting.placement)
        if value is None:
            raise ValueError(f"{kv.connector} needs {setting.placement} for {setting.flag}")
        argv += [setting.flag, str(value)]
    if spec.model.max_model_len is not None:
        argv += ["--max-model-len", str(spec.model.max_model_len)]
    if spec.router.policy == "prefix-aware":  # the router routes by the workers' KV-cache events
        if placement.kv_events_ports is None:
            raise ValueError("router.policy prefix-aware needs ports for the workers' KV-cache events")
        pub, replay = placement.kv_events_ports
        # at the address peers reach (the pod IP), never a wildcard: the events carry the prompts' token ids
        argv += ["--kv-events-endpoint", f"tcp://{placement.advertise_host}:{pub}",
                 "--kv-events-replay-endpoint", f"tcp://{placement.advertise_host}:{replay}"]
    if role == "decode" and placement.prefill_pool is not None:  # behind a gateway: the decode side's hop
        argv += placement.prefill_pool.flags("pd-")
    return WorkerCommand(argv)


def vllm_kv_transfer_config(spec: s.DisaggregatedInferenceSpec, role: Role) -> dict[str, Any]:
    """vLLM's NixlConnector per role: prefill produces KV (kept for decode to pull for the lease), decode
    consumes it. The buffer is host memory without GPUs (vLLM's CPU build), device memory with them."""
    kv = spec.kv_transfer
    return {"kv_connector": kv.connector,
            "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
            "kv_buffer_device": "cuda" if s.worker_gpus(spec, role) else "cpu",
            "kv_load_failure_policy": kv.load_failure_policy,
            "kv_connector_extra_config": {"kv_lease_duration": kv.lease_seconds}}


def vllm_kv_events_config(placement: Placement) -> dict[str, Any]:
    """vLLM's KVEventsConfig: its ZMQ publisher on the same ports as our workers' events (PUB, replay); the
    router subscribes at the worker's address (it has no GET /kv_events to ask). vLLM binds the PUB socket only
    for a wildcard host (any other address it connects to), so the PUB is `tcp://*:PORT` even where the worker's
    HTTP server binds one address (the chart README's security notes say so); the replay socket always binds,
    at the address peers reach (the pod IP)."""
    pub, replay = placement.kv_events_ports
    return {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{pub}",
            "replay_endpoint": f"tcp://{placement.advertise_host}:{replay}", "topic": KV_EVENTS_TOPIC}


def _vllm_command(spec: s.DisaggregatedInferenceSpec, role: Role, placement: Placement) -> WorkerCommand:
    r: s.RoleSpec = getattr(spec, role)
    argv = [VLLM_EXECUTABLE, "serve", placement.model_dir, "--served-model-name", spec.model.served_name,
            "--host", placement.host, "--port", str(placement.port), "--dtype", spec.model.dtype,
            "--tensor-parallel-size", str(r.tensor_parallel_size),
            "--kv-transfer-config", json.dumps(vllm_kv_transfer_config(spec, role), separators=(",", ":")),
            # SIGTERM: vLLM's default (0) aborts running requests; this drains them, inside the grace period
            "--shutdown-timeout", str(max(1, s.request_drain_seconds(spec, role)))]
    if spec.model.max_model_len is not None:
        argv += ["--max-model-len", str(spec.model.max_model_len)]
    if spec.router.policy == "prefix-aware":  # the router routes by the workers' KV-cache events
        if placement.kv_events_ports is None:
            raise ValueError("router.policy prefix-aware needs ports for the workers' KV-cache events")
        argv += ["--enable-prefix-caching",
                 "--kv-events-config", json.dumps(vllm_kv_events_config(placement), separators=(",", ":"))]
    env = {
        # the address decode workers reach this worker's NIXL side channel at (vLLM binds it too)
        "VLLM_NIXL_SIDE_CHANNEL_HOST": placement.advertise_host,
        "VLLM_NIXL_SIDE_CHANNEL_PORT": str(placement.side_channel_port),
    }
    return WorkerCommand(argv, env)


def build_fetch_command(spec: s.DisaggregatedInferenceSpec, dest: str) -> WorkerCommand:
    """`disagg fetch-model` for a huggingFace or uri source. Secrets (HF_TOKEN, S3 credentials) are not here:
    the Kubernetes adapter references them, `disagg up` takes them from its own environment."""
    src = spec.model.source
    env: dict[str, str] = {}
    if src.hugging_face is not None:
        argv = [EXECUTABLE, "fetch-model", "--hf-repo", src.hugging_face.repo]
        if src.hugging_face.revision:
            argv += ["--revision", src.hugging_face.revision]
        if src.hugging_face.endpoint:
            env["HF_ENDPOINT"] = src.hugging_face.endpoint
    elif src.uri is not None:
        argv = [EXECUTABLE, "fetch-model", "--uri", src.uri.url]
    else:
        raise ValueError(f"spec.model.source.{src.kind} is not downloaded")
    return WorkerCommand([*argv, "--dest", dest], env)


def owned_flags(spec: s.DisaggregatedInferenceSpec, role: Role, placement: Placement) -> set[str]:
    """The flags the builder sets from the spec: engineArgs and extraArgs may not repeat them."""
    build = _vllm_command if spec.engine == "vllm" else _disagg_command
    return {a for a in build(spec, role, placement).argv if a.startswith("--")}
