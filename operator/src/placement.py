"""Where each process runs, as its command line needs it: a worker's `Placement`, the router's `RouterPlacement`,
and on Kubernetes only the endpoint picker's `EppPlacement` and a vLLM pod's `ProxyPlacement` (`disagg pd-proxy`).

Built in one place per target, with keyword arguments: kubernetes_*() - the pods' fixed ports, the pod IP through
the downward API, the volumes' mount paths; local_*() - free ports on one host (`disagg up`). The command
builders (worker_command.py, router_command.py) take a placement and know nothing of the target.

Pure: no API calls, no processes.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import PurePosixPath

from disagg.operator import spec as s
from disagg.operator.naming import (
    ENGINE_PORT, EPP_GRPC_PORT, EPP_HEALTH_PORT, EPP_METRICS_PORT, HTTP_PORT, KV_EVENTS_PORTS, SIDE_CHANNEL_PORT,
    label_selector, stable_hash,
)

# where a worker pod mounts its volumes
MODELS_DIR = "/models"  # PVC mount
CACHE_DIR = "/cache"  # emptyDir or spec.model.cacheClaimName: downloaded checkpoints
SHARED_STORAGE_DIR = "/kv-shared"  # spec.kvTransfer.sharedStorage: SharedStorageConnector's directory
POD_IP = "$(POD_IP)"  # the kubelet expands it from the downward API's POD_IP variable
TLS_DIR = "/etc/disagg/tls"  # spec.router.tls: the kubernetes.io/tls Secret in the router pods (tls.crt, tls.key)
LOOPBACK = "127.0.0.1"  # engine vllm: vLLM listens on the pod's loopback, `disagg pd-proxy` in front of it


@dataclass(frozen=True)
class PrefillPool:
    """Where a decode worker behind a gateway finds the prefill pods its prefill hop may go to (its allowlist):
    Kubernetes pods of this resource."""
    namespace: str
    selector: str  # label selector of the resource's prefill pods
    port: int  # their HTTP port

    def flags(self, prefix: str = "") -> list[str]:
        """The routing flags naming the pool: `--discovery ...` (pd-proxy), `--pd-discovery ...` (our worker)."""
        p = f"--{prefix}"
        return [f"{p}discovery", "kubernetes", f"{p}namespace", self.namespace,
                f"{p}prefill-selector", self.selector, f"{p}worker-port", str(self.port)]


@dataclass(frozen=True)
class Placement:
    """Where one worker runs, as its command line needs it."""
    host: str  # address the HTTP server binds
    port: int  # HTTP port (API, /health, /ready, /metrics)
    advertise_host: str  # address peers reach this worker at: "$(POD_IP)" on Kubernetes
    side_channel_port: int  # NIXL side channel
    model_dir: str  # the checkpoint directory as the worker sees it
    shared_storage_path: str | None = None  # SharedStorageConnector's directory
    kv_events_ports: tuple[int, int] | None = None  # KV-cache events (PUB, replay) for a prefix-aware router
    prefill_pool: PrefillPool | None = None  # decode behind a gateway: where its own prefill hop may go


@dataclass(frozen=True)
class ProxyPlacement:
    """`disagg pd-proxy` in a vLLM pod: it owns the pod's HTTP port, vLLM listens behind it."""
    host: str
    port: int
    engine_url: str  # vLLM, on the pod's loopback
    prefill_pool: PrefillPool | None = None  # decode behind a gateway: its prefill hop's allowlist


@dataclass(frozen=True)
class EppPlacement:
    """The endpoint picker's ports and where it finds the workers."""
    host: str
    grpc_port: int  # ext_proc
    health_port: int  # gRPC health
    metrics_port: int  # HTTP /health, /ready, /metrics
    discovery: tuple[str, ...]
    kv_events_ports: tuple[int, int] | None = None  # as RouterPlacement's


@dataclass(frozen=True)
class RouterPlacement:
    """Where the router runs and where it finds its workers."""
    host: str  # address it binds
    port: int
    discovery: tuple[str, ...]  # its flags naming the workers: Kubernetes selectors, an endpoints file, or URLs
    probe_interval_s: float | None = None  # None: the router's default
    # where workers that serve no GET /kv_events (vLLM) publish KV-cache events: the pods' fixed ports
    kv_events_ports: tuple[int, int] | None = None
    tls_files: tuple[str, str] | None = None  # (certificate, key) it serves HTTPS with


# ---------------------------------------------------------------- Kubernetes
def kubernetes_placement(*, model_dir: str, shared_storage: bool, engine: str = "disagg",
                         prefill_pool: PrefillPool | None = None) -> Placement:
    """A worker pod: every port fixed, peers reach it at its pod IP. Engine vllm listens on the pod's loopback
    (kubernetes_proxy_placement owns the pod's HTTP port); its side channel and KV events at the pod IP."""
    host, port = (LOOPBACK, ENGINE_PORT) if engine == "vllm" else ("0.0.0.0", HTTP_PORT)
    return Placement(host=host, port=port, advertise_host=POD_IP, side_channel_port=SIDE_CHANNEL_PORT,
                     model_dir=model_dir, shared_storage_path=SHARED_STORAGE_DIR if shared_storage else None,
                     kv_events_ports=KV_EVENTS_PORTS, prefill_pool=prefill_pool)


def kubernetes_prefill_pool(*, namespace: str, instance: str) -> PrefillPool:
    return PrefillPool(namespace=namespace, selector=label_selector(instance, "prefill"), port=HTTP_PORT)


def kubernetes_proxy_placement(prefill_pool: PrefillPool | None) -> ProxyPlacement:
    return ProxyPlacement(host="0.0.0.0", port=HTTP_PORT, engine_url=f"http://{LOOPBACK}:{ENGINE_PORT}",
                          prefill_pool=prefill_pool)


def _kubernetes_discovery(namespace: str, instance: str) -> tuple[str, ...]:
    return ("--discovery", "kubernetes", "--namespace", namespace,
            "--prefill-selector", label_selector(instance, "prefill"),
            "--decode-selector", label_selector(instance, "decode"))


def kubernetes_router_placement(*, namespace: str, instance: str, tls: bool = False) -> RouterPlacement:
    """The router pod: it lists the resource's worker pods by their labels; with `tls` it serves HTTPS with the
    Secret mounted at TLS_DIR."""
    return RouterPlacement(host="0.0.0.0", port=HTTP_PORT, discovery=_kubernetes_discovery(namespace, instance),
                           kv_events_ports=KV_EVENTS_PORTS,
                           tls_files=(f"{TLS_DIR}/tls.crt", f"{TLS_DIR}/tls.key") if tls else None)


def kubernetes_epp_placement(*, namespace: str, instance: str) -> EppPlacement:
    """The endpoint picker's pod: GIE's ports, the same discovery as the router."""
    return EppPlacement(host="0.0.0.0", grpc_port=EPP_GRPC_PORT, health_port=EPP_HEALTH_PORT,
                        metrics_port=EPP_METRICS_PORT, discovery=_kubernetes_discovery(namespace, instance),
                        kv_events_ports=KV_EVENTS_PORTS)


def pod_model_dir(spec: s.DisaggregatedInferenceSpec) -> str:
    """The checkpoint directory as the worker container sees it."""
    src = spec.model.source
    if src.pvc is not None:
        return str(PurePosixPath(MODELS_DIR) / src.pvc.path) if src.pvc.path else MODELS_DIR
    if src.downloaded:
        return model_cache_dir(spec, CACHE_DIR)
    if src.path is None:
        raise ValueError("spec.model.source: a generated checkpoint cannot run on Kubernetes")
    return src.path


def model_cache_dir(spec: s.DisaggregatedInferenceSpec, cache_root: str) -> str:
    """Where a downloaded source lands under the cache: one directory per source, so sources sharing a cache
    PVC never collide and the same source is found again."""
    source = spec.model.source.model_dump(by_alias=True, exclude_none=True)
    return str(PurePosixPath(cache_root) / "models" / stable_hash(source, 12))


# ---------------------------------------------------------------- one host
def local_placement(*, host: str, port_for: Callable[[], int], model_dir: str, kv_dir: str,
                    kv_events: bool) -> Placement:
    """A worker process on `host`, on fresh ports (`port_for()` hands out a free one): HTTP, then the KV-events
    pair when `kv_events`, then the side channel."""
    port = port_for()
    events = (port_for(), port_for()) if kv_events else None
    return Placement(host=host, port=port, advertise_host=host, side_channel_port=port_for(), model_dir=model_dir,
                     shared_storage_path=kv_dir, kv_events_ports=events)


def local_router_placement(*, host: str, port: int, probe_interval_s: float, endpoints_file: str | None = None,
                           prefill_urls: Sequence[str] = (), decode_urls: Sequence[str] = ()) -> RouterPlacement:
    """The router process: it follows `endpoints_file` (rewritten as workers come and go), else the URLs given.
    Workers announce their KV-events ports in that file, so none are fixed here."""
    discovery = (("--discovery", "file", "--endpoints-file", endpoints_file) if endpoints_file is not None
                 else ("--prefill", *prefill_urls, "--decode", *decode_urls))
    return RouterPlacement(host=host, port=port, discovery=discovery, probe_interval_s=probe_interval_s)
