"""The one API through which the operator's pods and `disagg up`'s processes are planned: a spec and a target's
placement -> each worker's command, environment and ports, the router's command, the replicas each pool starts
with, and where the model is. manifests.py wraps the Kubernetes half in pod templates; worker/local/ runs the
local half as processes and imports nothing else of the operator but the autoscaling pass.

Pure: no API calls, no processes.
"""
from __future__ import annotations

import math

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from disagg.operator import spec as s
from disagg.operator.checks import Problem, check_spec
from disagg.operator.naming import KV_EVENTS_TOPIC
from disagg.operator.epp_command import build_epp_command
from disagg.operator.pd_proxy_command import build_pd_proxy_command
from disagg.operator.placement import (
    EppPlacement, PrefillPool, kubernetes_epp_placement, kubernetes_placement, kubernetes_prefill_pool,
    kubernetes_proxy_placement, kubernetes_router_placement, local_epp_placement, local_placement,
    local_prefill_pool, local_proxy_placement, local_router_placement, model_cache_dir, pod_model_dir,
)
from disagg.operator.router_command import build_router_command
from disagg.operator.worker_command import Role, WorkerCommand, build_fetch_command, build_worker_command

__all__ = ["LocalWorker", "Problem", "Role", "autoscaler_owns_replicas", "check_local", "initial_replicas",
           "local_epp_command", "local_router_command", "local_worker", "model_cache_dir", "pod_epp_command",
           "pod_fetch_command", "pod_model_dir", "pod_pd_proxy_command", "pod_router_command", "pod_worker_command"]


# ---------------------------------------------------------------- replicas (both targets)
def autoscaler_owns_replicas(spec: s.DisaggregatedInferenceSpec) -> bool:
    """The autoscaler applies its decisions to the worker pools (a dry run only reports them)."""
    return spec.autoscaling.builtin() and not spec.autoscaling.dry_run


def initial_replicas(spec: s.DisaggregatedInferenceSpec, role: Role) -> int:
    """The replicas a worker pool starts with: spec.<role>.replicas, moved into autoscaling's min/max when the
    autoscaler owns the pool (then only the starting point). A dry run changes nothing, so the spec's number
    stands. Mode external: the pools' replicas always (decode is the /scale subresource's; prefill follows it)."""
    a = spec.autoscaling
    n = getattr(spec, role).replicas
    if autoscaler_owns_replicas(spec) or a.enabled and a.mode == "external":
        n = _within(n, getattr(a, role))
    if a.enabled and a.mode == "external" and role == "prefill":
        n = _within(prefill_following(n, initial_replicas(spec, "decode"), a.prefill_decode_ratio), a.prefill)
    return n


def _within(n: int, bounds: s.ReplicaBounds) -> int:
    return min(max(n, bounds.min_replicas), bounds.max_replicas)


def prefill_following(prefill: int, decode: int, ratio: s.PrefillDecodeRatio) -> int:
    """Prefill replicas moved into prefill/decode's [min, max] ratio for this many decode replicas: an outside
    autoscaler drives decode alone (/scale), prefill keeps in step."""
    if ratio.min is not None:
        prefill = max(prefill, math.ceil(decode * ratio.min.prefill / ratio.min.decode))
    if ratio.max is not None:
        prefill = min(prefill, decode * ratio.max.prefill // ratio.max.decode)
    return prefill


# ---------------------------------------------------------------- Kubernetes: pods
def _prefill_pool(spec: s.DisaggregatedInferenceSpec, role: Role, namespace: str, instance: str) -> PrefillPool | None:
    """Behind a gateway a decode pod runs the prefill hop itself, only to this resource's prefill pods."""
    if role != "decode" or not spec.gateway.enabled:
        return None
    return kubernetes_prefill_pool(namespace=namespace, instance=instance)


def pod_worker_command(spec: s.DisaggregatedInferenceSpec, role: Role, *, namespace: str,
                       instance: str) -> WorkerCommand:
    """The engine's container (vLLM behind pod_pd_proxy_command's, on the pod's loopback)."""
    placement = kubernetes_placement(model_dir=pod_model_dir(spec),
                                     shared_storage=spec.kv_transfer.shared_storage is not None,
                                     engine=spec.engine, prefill_pool=_prefill_pool(spec, role, namespace, instance))
    return build_worker_command(spec, role, placement)


def pod_pd_proxy_command(spec: s.DisaggregatedInferenceSpec, role: Role, *, namespace: str,
                         instance: str) -> list[str]:
    """engine vllm: the container in front of vLLM that owns the pod's HTTP port."""
    return build_pd_proxy_command(spec, role, kubernetes_proxy_placement(
        _prefill_pool(spec, role, namespace, instance)))


def pod_epp_command(spec: s.DisaggregatedInferenceSpec, *, namespace: str, instance: str) -> list[str]:
    return build_epp_command(spec, kubernetes_epp_placement(namespace=namespace, instance=instance))


def pod_fetch_command(spec: s.DisaggregatedInferenceSpec) -> WorkerCommand:
    """The init container's download, into the directory the worker container loads."""
    return build_fetch_command(spec, pod_model_dir(spec))


def pod_router_command(spec: s.DisaggregatedInferenceSpec, *, namespace: str, instance: str) -> list[str]:
    return build_router_command(spec, kubernetes_router_placement(namespace=namespace, instance=instance,
                                                                  tls=spec.router.tls is not None))


# ---------------------------------------------------------------- one host: processes
@dataclass(frozen=True)
class LocalWorker:
    argv: list[str]  # argv[0] names the program (EXECUTABLE or VLLM_EXECUTABLE); the launcher runs its own
    env: dict[str, str]  # the engine's variables, then the values of spec.<role>.env
    url: str  # http://host:port
    kv_events: dict[str, str] | None  # announced in the router's endpoints file (vLLM serves no GET /kv_events)


def local_worker(spec: s.DisaggregatedInferenceSpec, role: Role, *, host: str, port_for: Callable[[], int],
                 model_dir: str, kv_dir: str, endpoints_file: str | None = None,
                 gateway: bool = False) -> LocalWorker:
    """One prefill or decode worker on `host`, on fresh ports (`port_for()` hands out a free one). With `gateway`
    a decode worker takes prefill targets from the prefill workers of `endpoints_file` (its allowlist). Engine
    vllm runs as on Kubernetes, behind `disagg pd-proxy`, which here starts it (`pd-proxy ... -- vllm serve ...`)
    and owns the worker's URL; vLLM listens on a port of its own."""
    prefix_aware = spec.router.policy == "prefix-aware"
    pool = local_prefill_pool(endpoints_file) if gateway and role == "decode" and endpoints_file else None
    proxy_port = port_for() if spec.engine == "vllm" else None
    placement = local_placement(host=host, port_for=port_for, model_dir=model_dir, kv_dir=kv_dir,
                                kv_events=prefix_aware, prefill_pool=pool)
    command = build_worker_command(spec, role, placement)
    env = {**command.env, **{e.name: e.value for e in getattr(spec, role).env if e.value is not None}}
    kv_events = None
    if placement.kv_events_ports is not None:
        pub, replay = placement.kv_events_ports
        kv_events = {"endpoint": f"tcp://{host}:{pub}", "replay_endpoint": f"tcp://{host}:{replay}",
                     "topic": KV_EVENTS_TOPIC if spec.engine == "vllm" else ""}
    if proxy_port is None:
        return LocalWorker(command.argv, env, f"http://{host}:{placement.port}", kv_events)
    proxy = build_pd_proxy_command(spec, role, local_proxy_placement(
        host=host, port=proxy_port, engine_url=f"http://{host}:{placement.port}", prefill_pool=pool))
    return LocalWorker([*proxy, "--", *command.argv], env, f"http://{host}:{proxy_port}", kv_events)


def local_epp_command(spec: s.DisaggregatedInferenceSpec, *, host: str, port_for: Callable[[], int],
                      endpoints_file: str, probe_interval_s: float) -> tuple[list[str], EppPlacement]:
    """`disagg up --gateway`'s endpoint picker on fresh ports, following the launcher's endpoints file."""
    placement = local_epp_placement(host=host, port_for=port_for, endpoints_file=endpoints_file,
                                    probe_interval_s=probe_interval_s)
    return build_epp_command(spec, placement), placement


def local_router_command(spec: s.DisaggregatedInferenceSpec, *, host: str, port: int, probe_interval_s: float,
                         endpoints_file: str | None = None, prefill_urls: Sequence[str] = (),
                         decode_urls: Sequence[str] = ()) -> list[str]:
    """The router process: it follows `endpoints_file` when given, else the workers' URLs."""
    placement = local_router_placement(host=host, port=port, probe_interval_s=probe_interval_s,
                                       endpoints_file=endpoints_file, prefill_urls=prefill_urls,
                                       decode_urls=decode_urls)
    return build_router_command(spec, placement)


def check_local(raw: Any) -> tuple[s.DisaggregatedInferenceSpec | None, list[Problem]]:
    """check_spec for `disagg up`, and that the plan starts a decode worker (nothing would serve without one)."""
    spec, problems = check_spec(raw, "local")
    if spec is None or problems:
        return spec, problems
    a = spec.autoscaling
    if a.enabled and a.decode.min_replicas < 1:
        return spec, [Problem("spec.autoscaling.decode.minReplicas",
                              f"must be >= 1 to serve locally, got {a.decode.min_replicas}")]
    if initial_replicas(spec, "decode") < 1:
        return spec, [Problem("spec.decode.replicas", "must be >= 1 to serve locally")]
    return spec, []
