"""Pure functions: a DisaggregatedInference spec -> the manifests of its children. No API calls.

Children of a resource named N in namespace NS:
  Deployment N-prefill, N-decode, N-router; Service N (router, the endpoint);
  headless Services N-prefill, N-decode (pod discovery + the NIXL side channel);
  ServiceAccount/Role/RoleBinding N-router (the router lists and watches pods to discover workers).

Somewhat over 300 lines: every child of one resource is built here so their shared labels, volumes and security
context stay consistent; the commands in them come from plan.py (the API `disagg up` plans its processes with).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from disagg.operator import spec as s
from disagg.operator.naming import (
    ANNOTATION_CONFIG_HASH, HTTP_PORT, KV_EVENTS_PORTS, LABEL_REVISION, SIDE_CHANNEL_PORT, Component, child_name,
    common_labels, selector_labels, stable_hash,
)
from disagg.operator.placement import CACHE_DIR, MODELS_DIR, SHARED_STORAGE_DIR
from disagg.operator.plan import Role, pod_fetch_command, pod_router_command, pod_worker_command

TMP_DIR = "/tmp"  # emptyDir: the root filesystem is read-only
IPC_LOCK = "IPC_LOCK"  # RDMA only: lets UCX register (pin) memory beyond RLIMIT_MEMLOCK


@dataclass(frozen=True)
class Owner:
    """The DisaggregatedInference the children belong to."""
    name: str
    namespace: str
    uid: str

    def reference(self) -> dict[str, Any]:
        return {"apiVersion": s.API_VERSION, "kind": s.KIND, "name": self.name, "uid": self.uid,
                "controller": True, "blockOwnerDeletion": True}


def serving_revision(spec: s.DisaggregatedInferenceSpec) -> str:
    """What prefill and decode must share for KV blocks to be compatible: model, image, KV transfer (and the
    engine when it is not the default, so that revisions of existing disagg resources stay as they were)."""
    fields = {"model", "image", "kv_transfer"} | ({"engine", "engine_image"} if spec.engine != "disagg" else set())
    return stable_hash(spec.model_dump(by_alias=True, include=fields), 10)


def router_endpoint(owner: Owner, spec: s.DisaggregatedInferenceSpec) -> str:
    return f"http://{owner.name}.{owner.namespace}.svc:{spec.router.service.port}"


def _metadata(owner: Owner, name: str, component: Component) -> dict[str, Any]:
    return {"name": name, "namespace": owner.namespace, "labels": common_labels(owner.name, component),
            "ownerReferences": [owner.reference()]}


# ---------------------------------------------------------------- worker pods
# engine vllm: the root filesystem is read-only, so vLLM's caches (compile, torch inductor) go to the /tmp emptyDir
VLLM_POD_ENV = {"VLLM_CACHE_ROOT": f"{TMP_DIR}/vllm", "XDG_CACHE_HOME": f"{TMP_DIR}/.cache",
                "HOME": TMP_DIR}


def worker_image(spec: s.DisaggregatedInferenceSpec) -> str | None:
    return spec.engine_image or spec.image if spec.engine == "vllm" else spec.image


def ready_path(spec: s.DisaggregatedInferenceSpec) -> str:
    return "/health" if spec.engine == "vllm" else "/ready"


def _kv_events_ports(spec: s.DisaggregatedInferenceSpec) -> list[dict[str, Any]]:
    """The workers' KV-cache event ports, exposed where the router subscribes to them."""
    if spec.router.policy != "prefix-aware":
        return []
    return [{"name": "kv-events", "containerPort": KV_EVENTS_PORTS[0], "protocol": "TCP"},
            {"name": "kv-events-replay", "containerPort": KV_EVENTS_PORTS[1], "protocol": "TCP"}]


def _downward_env() -> list[dict[str, Any]]:
    def field(path: str) -> dict[str, Any]:
        return {"fieldRef": {"fieldPath": path}}
    return [{"name": "POD_IP", "valueFrom": field("status.podIP")},
            {"name": "POD_NAME", "valueFrom": field("metadata.name")},
            {"name": "POD_NAMESPACE", "valueFrom": field("metadata.namespace")}]


def _user_env(env: list[s.EnvVar]) -> list[dict[str, Any]]:
    return [e.model_dump(by_alias=True, exclude_none=True) for e in env]


def _resources(res: s.Resources, extended: dict[str, int] | None = None) -> dict[str, Any]:
    """`extended`: device-plugin resources (GPUs, RDMA devices) -> count; their request must equal the limit."""
    out: dict[str, Any] = {}
    requests = {k: str(v) for k, v in res.requests.items()}
    limits = {k: str(v) for k, v in res.limits.items()}
    for name, count in (extended or {}).items():
        if count:
            requests[name] = limits[name] = str(count)
    if requests:
        out["requests"] = requests
    if limits:
        out["limits"] = limits
    return out


def _placement(p: s.PodPlacement) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if p.node_selector:
        out["nodeSelector"] = dict(p.node_selector)
    if p.tolerations:
        out["tolerations"] = [t.model_dump(by_alias=True, exclude_none=True) for t in p.tolerations]
    if p.affinity is not None:
        out["affinity"] = p.affinity.model_dump(by_alias=True)
    return out


def _model_volumes(spec: s.DisaggregatedInferenceSpec) -> tuple[list[dict], list[dict]]:
    """(volumes, the worker's mounts) for the model source and the shared KV storage."""
    src, volumes, mounts = spec.model.source, [], []
    if src.pvc is not None:
        volumes.append({"name": "model", "persistentVolumeClaim": {"claimName": src.pvc.claim_name,
                                                                   "readOnly": True}})
        mounts.append({"name": "model", "mountPath": MODELS_DIR, "readOnly": True})
    if src.downloaded:
        claim = spec.model.cache_claim_name
        volumes.append({"name": "cache", **({"persistentVolumeClaim": {"claimName": claim}} if claim
                                            else {"emptyDir": {}})})
        mounts.append({"name": "cache", "mountPath": CACHE_DIR, "readOnly": True})
    if spec.kv_transfer.shared_storage is not None:
        volumes.append({"name": "kv-shared",
                        "persistentVolumeClaim": {"claimName": spec.kv_transfer.shared_storage.claim_name}})
        mounts.append({"name": "kv-shared", "mountPath": SHARED_STORAGE_DIR})
    return volumes, mounts


def _fetch_init_container(spec: s.DisaggregatedInferenceSpec, tmp_mount: dict[str, Any]) -> dict[str, Any]:
    """Downloads the checkpoint into the cache volume before the worker starts (skipped when it is there)."""
    src = spec.model.source
    fetch = pod_fetch_command(spec)
    env = [{"name": "HF_HOME", "value": f"{CACHE_DIR}/huggingface"},
           *({"name": k, "value": v} for k, v in fetch.env.items())]
    container: dict[str, Any] = {"name": "fetch-model", "image": spec.image, "command": fetch.argv[:1],
                                 "args": fetch.argv[1:], "env": env,
                                 "volumeMounts": [{"name": "cache", "mountPath": CACHE_DIR}, tmp_mount],
                                 "securityContext": container_security_context()}
    hf = src.hugging_face
    if hf is not None and hf.token_secret:
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": hf.token_secret,
                                                                       "key": hf.token_secret_key}}})
    if src.uri is not None and src.uri.credentials_secret:
        container["envFrom"] = [{"secretRef": {"name": src.uri.credentials_secret}}]
    if spec.image_pull_policy:
        container["imagePullPolicy"] = spec.image_pull_policy
    return container


# ---------------------------------------------------------------- security
def pod_security_context() -> dict[str, Any]:
    """Every pod: the image's non-root user (UID 10001 in the Dockerfile), the runtime's default seccomp profile."""
    return {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}


def container_security_context(add: tuple[str, ...] = ()) -> dict[str, Any]:
    """No capabilities but `add`, no privilege escalation, a read-only root filesystem: the worker and the router
    write only to mounted volumes (/tmp, /dev/shm, the model cache)."""
    capabilities: dict[str, Any] = {"drop": ["ALL"]}
    if add:
        capabilities["add"] = list(add)
    return {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "capabilities": capabilities}


def worker_capabilities(spec: s.DisaggregatedInferenceSpec) -> tuple[str, ...]:
    return (IPC_LOCK,) if spec.kv_transfer.rdma.enabled else ()


def _tmp_volume() -> tuple[dict[str, Any], dict[str, Any]]:
    """(volume, mount) of the writable /tmp."""
    return {"name": "tmp", "emptyDir": {}}, {"name": "tmp", "mountPath": TMP_DIR}


def _probe(path: str, period: int, failures: int) -> dict[str, Any]:
    return {"httpGet": {"path": path, "port": "http"}, "periodSeconds": period, "failureThreshold": failures,
            "timeoutSeconds": 5}


def _pod_template(labels: dict[str, str], pod_spec: dict[str, Any]) -> dict[str, Any]:
    template = {"metadata": {"labels": labels}, "spec": pod_spec}
    template["metadata"]["annotations"] = {ANNOTATION_CONFIG_HASH: stable_hash(template)}
    return template


def build_worker_deployment(owner: Owner, spec: s.DisaggregatedInferenceSpec, role: Role) -> dict[str, Any]:
    r: s.RoleSpec = getattr(spec, role)
    volumes, mounts = _model_volumes(spec)
    command = pod_worker_command(spec, role)
    tmp, tmp_mount = _tmp_volume()
    rdma = spec.kv_transfer.rdma
    devices = {"nvidia.com/gpu": s.worker_gpus(spec, role)}
    if rdma.enabled and rdma.resource_name:
        devices[rdma.resource_name] = 1
    shm: dict[str, Any] = {"medium": "Memory"}
    if r.shared_memory_size is not None:
        shm["sizeLimit"] = str(r.shared_memory_size)
    engine_env = {**command.env, **(VLLM_POD_ENV if spec.engine == "vllm" else {})}
    container: dict[str, Any] = {
        "name": role,
        "image": worker_image(spec),
        "command": command.argv[:1],
        "args": command.argv[1:],
        "ports": [{"name": "http", "containerPort": HTTP_PORT, "protocol": "TCP"},
                  {"name": "kv-side-channel", "containerPort": SIDE_CHANNEL_PORT, "protocol": "TCP"},
                  *_kv_events_ports(spec)],
        "env": _downward_env() + [{"name": k, "value": v} for k, v in engine_env.items()] + _user_env(r.env),
        "resources": _resources(r.resources, devices),
        "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}, tmp_mount, *mounts],
        # loading weights can take long: the startup probe holds liveness off until /health answers
        "startupProbe": _probe("/health", 10, 180),
        "livenessProbe": _probe("/health", 10, 3),
        # vLLM has no /ready: its /health answers once the engine serves; a terminating vLLM pod leaves the
        # router because discovery drops pods with a deletionTimestamp, and the preStop wait covers the gap
        "readinessProbe": _probe(ready_path(spec), 5, 2),
        "securityContext": container_security_context(worker_capabilities(spec)),
    }
    if spec.image_pull_policy:
        container["imagePullPolicy"] = spec.image_pull_policy
    if r.drain_delay_seconds:  # the router stops sending (disagg: /ready turns false on SIGTERM) before SIGTERM
        container["lifecycle"] = {"preStop": {"exec": {"command": ["sleep", str(r.drain_delay_seconds)]}}}
    pod_spec: dict[str, Any] = {
        "securityContext": pod_security_context(),
        **({"initContainers": [_fetch_init_container(spec, tmp_mount)]} if spec.model.source.downloaded else {}),
        "containers": [container],
        "volumes": [{"name": "dshm", "emptyDir": shm}, tmp, *volumes],
        "terminationGracePeriodSeconds": r.termination_grace_period_seconds,
        **_placement(r),
    }
    if spec.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": n} for n in spec.image_pull_secrets]
    labels = {**common_labels(owner.name, role), LABEL_REVISION: serving_revision(spec)}
    return {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": _metadata(owner, child_name(owner.name, role), role),
        "spec": {"replicas": r.replicas, "selector": {"matchLabels": selector_labels(owner.name, role)},
                 "template": _pod_template(labels, pod_spec)},
    }


# ---------------------------------------------------------------- router
ROUTER_PRESTOP_S = 5  # the router pod's preStop sleep: endpoint removal reaches kube-proxy and gateways meanwhile
ROUTER_GRACE_MARGIN_S = 5


def build_router_deployment(owner: Owner, spec: s.DisaggregatedInferenceSpec) -> dict[str, Any]:
    tmp, tmp_mount = _tmp_volume()
    argv = pod_router_command(spec, namespace=owner.namespace, instance=owner.name)
    container: dict[str, Any] = {
        "name": "router", "image": spec.image, "command": argv[:1], "args": argv[1:],
        "ports": [{"name": "http", "containerPort": HTTP_PORT, "protocol": "TCP"}],
        "env": _downward_env(),
        "resources": _resources(spec.router.resources),
        "livenessProbe": _probe("/health", 10, 3),
        "readinessProbe": _probe("/ready", 5, 2),  # 503 until the router sees a decode endpoint
        "securityContext": container_security_context(),  # moves HTTP only: never IPC_LOCK
        "volumeMounts": [tmp_mount],
        # the Service drops the terminating pod while this sleeps; then SIGTERM: /ready 503 for --drain-delay,
        # the listener closes, open requests get --drain-timeout (worker/router/draining.py)
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(ROUTER_PRESTOP_S)]}}},
    }
    if spec.image_pull_policy:
        container["imagePullPolicy"] = spec.image_pull_policy
    import math

    from disagg.worker.router.draining import CUT_GRACE_S, DRAIN_DELAY_S, DRAIN_TIMEOUT_S

    drain = {"--drain-delay": DRAIN_DELAY_S, "--drain-timeout": DRAIN_TIMEOUT_S}
    for flag, value in zip(argv, argv[1:]):  # the router's own flags (extraArgs may set them; the last wins)
        if flag in drain and value.replace(".", "", 1).isdigit():
            drain[flag] = float(value)
    pod_spec: dict[str, Any] = {"serviceAccountName": child_name(owner.name, "router"),
                                "securityContext": pod_security_context(), "containers": [container],
                                "volumes": [tmp], **_placement(spec.router),
                                # longer than everything above, so that no stream is cut by a SIGKILL
                                "terminationGracePeriodSeconds": ROUTER_PRESTOP_S + math.ceil(
                                    sum(drain.values()) + CUT_GRACE_S) + ROUTER_GRACE_MARGIN_S}
    if spec.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": n} for n in spec.image_pull_secrets]
    return {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": _metadata(owner, child_name(owner.name, "router"), "router"),
        "spec": {"replicas": spec.router.replicas, "selector": {"matchLabels": selector_labels(owner.name, "router")},
                 "template": _pod_template(common_labels(owner.name, "router"), pod_spec)},
    }


def build_router_service(owner: Owner, spec: s.DisaggregatedInferenceSpec) -> dict[str, Any]:
    return {
        "apiVersion": "v1", "kind": "Service",
        "metadata": _metadata(owner, owner.name, "router"),
        "spec": {"type": spec.router.service.type, "selector": selector_labels(owner.name, "router"),
                 "ports": [{"name": "http", "port": spec.router.service.port, "targetPort": "http",
                            "protocol": "TCP"}]},
    }


def build_headless_service(owner: Owner, role: Role) -> dict[str, Any]:
    return {
        "apiVersion": "v1", "kind": "Service",
        "metadata": _metadata(owner, child_name(owner.name, role), role),
        "spec": {"clusterIP": "None", "selector": selector_labels(owner.name, role),
                 "ports": [{"name": "http", "port": HTTP_PORT, "targetPort": "http", "protocol": "TCP"},
                           {"name": "kv-side-channel", "port": SIDE_CHANNEL_PORT, "targetPort": "kv-side-channel",
                            "protocol": "TCP"}]},
    }


def build_router_rbac(owner: Owner) -> list[dict[str, Any]]:
    name = child_name(owner.name, "router")
    rbac = "rbac.authorization.k8s.io/v1"
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _metadata(owner, name, "router")},
        {"apiVersion": rbac, "kind": "Role", "metadata": _metadata(owner, name, "router"),
         "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]},
        {"apiVersion": rbac, "kind": "RoleBinding", "metadata": _metadata(owner, name, "router"),
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
         "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": owner.namespace}]},
    ]


# ---------------------------------------------------------------- everything
def desired_children(owner: Owner, spec: s.DisaggregatedInferenceSpec) -> list[dict[str, Any]]:
    """Order matters: RBAC and Services before the Deployments that use them."""
    return [*build_router_rbac(owner),
            build_headless_service(owner, "prefill"), build_headless_service(owner, "decode"),
            build_router_service(owner, spec),
            build_worker_deployment(owner, spec, "prefill"), build_worker_deployment(owner, spec, "decode"),
            build_router_deployment(owner, spec)]
