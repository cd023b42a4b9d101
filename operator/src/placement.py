"""Where each process runs, as its command line needs it: a worker's `Placement`, the router's `RouterPlacement`.

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
from disagg.operator.naming import HTTP_PORT, KV_EVENTS_PORTS, SIDE_CHANNEL_PORT, label_selector, stable_hash

# where a worker pod mounts its volumes
MODELS_DIR = "/models"  # PVC mount
CACHE_DIR = "/cache"  # emptyDir or spec.model.cacheClaimName: downloaded checkpoints
SHARED_STORAGE_DIR = "/kv-shared"  # spec.kvTransfer.sharedStorage: SharedStorageConnector's directory
POD_IP = "$(POD_IP)"  # the kubelet expands it from the downward API's POD_IP variable


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


@dataclass(frozen=True)
class RouterPlacement:
    """Where the router runs and where it finds its workers."""
    host: str  # address it binds
    port: int
    discovery: tuple[str, ...]  # its flags naming the workers: Kubernetes selectors, an endpoints file, or URLs
    probe_interval_s: float | None = None  # None: the router's default
    # where workers that serve no GET /kv_events (vLLM) publish KV-cache events: the pods' fixed ports
    kv_events_ports: tuple[int, int] | None = None


# ---------------------------------------------------------------- Kubernetes
def kubernetes_placement(*, model_dir: str, shared_storage: bool) -> Placement:
    """A worker pod: every port fixed, peers reach it at its pod IP."""
    return Placement(host="0.0.0.0", port=HTTP_PORT, advertise_host=POD_IP, side_channel_port=SIDE_CHANNEL_PORT,
                     model_dir=model_dir, shared_storage_path=SHARED_STORAGE_DIR if shared_storage else None,
                     kv_events_ports=KV_EVENTS_PORTS)


def kubernetes_router_placement(*, namespace: str, instance: str) -> RouterPlacement:
    """The router pod: it lists the resource's worker pods by their labels."""
    discovery = ("--discovery", "kubernetes", "--namespace", namespace,
                 "--prefill-selector", label_selector(instance, "prefill"),
                 "--decode-selector", label_selector(instance, "decode"))
    return RouterPlacement(host="0.0.0.0", port=HTTP_PORT, discovery=discovery, kv_events_ports=KV_EVENTS_PORTS)


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
