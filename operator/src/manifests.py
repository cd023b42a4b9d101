"""Pure functions: a DisaggregatedInference spec -> the manifests of its children. No API calls.

Children of a resource named N in namespace NS:
  Deployment N-prefill, N-decode, N-router; Service N (router, the endpoint);
  headless Services N-prefill, N-decode (pod discovery + the NIXL side channel);
  ServiceAccount/Role/RoleBinding N-router (the router lists and watches pods to discover workers);
  with spec.gateway: the InferencePool, the endpoint picker, the HTTPRoute (gateway_manifests.py) and
    ServiceAccount/Role/RoleBinding N-worker (decode pods list the prefill pods their own hop may go to);
  NetworkPolicies N-prefill, N-decode, N-router (N-epp) unless turned off (network_policy.py);
  the Secret N-handoff is created once by reconcile (handoff_key.py), not here: its key is random.
Engine vllm: each worker pod runs vLLM on its loopback and `disagg pd-proxy` in front of it (the pod's HTTP
port and probes).

The worker pods' shared volumes and containers are built here; what every child shares is in pod_parts.py; the
commands come from plan.py (the API `disagg up` plans its processes with).
"""
from __future__ import annotations

import math
from typing import Any

from disagg.operator import spec as s
from disagg.operator.gateway_manifests import gateway_children
from disagg.operator.handoff_key import handoff_env
from disagg.operator.naming import (
    HTTP_PORT, KV_EVENTS_PORTS, LABEL_REVISION, SIDE_CHANNEL_PORT, child_name, common_labels, selector_labels,
    stable_hash,
)
from disagg.operator.network_policy import build_network_policies
from disagg.operator.placement import CACHE_DIR, MODELS_DIR, SHARED_STORAGE_DIR, TLS_DIR
from disagg.operator.plan import (
    Role, pod_fetch_command, pod_pd_proxy_command, pod_router_command, pod_worker_command,
)
from disagg.operator.pod_parts import (
    TMP_DIR, Owner, client_key_env, container_security_context, downward_env, http_probe, metadata, pod_reader_rbac,
    pod_security_context, pod_template, pull_fields, resources, scheduling, tmp_volume,
)
from disagg.worker.router.draining import CUT_GRACE_S, DRAIN_DELAY_S, DRAIN_TIMEOUT_S

__all__ = ["Owner", "Role", "build_headless_service", "build_router_deployment", "build_router_rbac",
           "build_router_service", "build_worker_deployment", "build_worker_rbac", "container_security_context",
           "desired_children", "pod_security_context", "possible_children", "router_endpoint", "serving_revision",
           "worker_image"]

IPC_LOCK = "IPC_LOCK"  # RDMA only: lets UCX register (pin) memory beyond RLIMIT_MEMLOCK
PD_PROXY = "pd-proxy"  # engine vllm: the container in front of vLLM


def serving_revision(spec: s.DisaggregatedInferenceSpec) -> str:
    """What prefill and decode must share for KV blocks to be compatible: model, image, KV transfer (and the
    engine when it is not the default, so that revisions of existing disagg resources stay as they were)."""
    fields = {"model", "image", "kv_transfer"} | ({"engine", "engine_image"} if spec.engine != "disagg" else set())
    return stable_hash(spec.model_dump(by_alias=True, include=fields), 10)


def router_endpoint(owner: Owner, spec: s.DisaggregatedInferenceSpec) -> str:
    scheme = "https" if spec.router.tls else "http"
    return f"{scheme}://{owner.name}.{owner.namespace}.svc:{spec.router.service.port}"


# ---------------------------------------------------------------- worker pods
# engine vllm: the root filesystem is read-only, so vLLM's caches (compile, torch inductor) go to the /tmp emptyDir
VLLM_POD_ENV = {"VLLM_CACHE_ROOT": f"{TMP_DIR}/vllm", "XDG_CACHE_HOME": f"{TMP_DIR}/.cache",
                "HOME": TMP_DIR}


def worker_image(spec: s.DisaggregatedInferenceSpec) -> str | None:
    return spec.engine_image or spec.image if spec.engine == "vllm" else spec.image


def _kv_events_ports(spec: s.DisaggregatedInferenceSpec) -> list[dict[str, Any]]:
    """The workers' KV-cache event ports, exposed where the router subscribes to them."""
    if spec.router.policy != "prefix-aware":
        return []
    return [{"name": "kv-events", "containerPort": KV_EVENTS_PORTS[0], "protocol": "TCP"},
            {"name": "kv-events-replay", "containerPort": KV_EVENTS_PORTS[1], "protocol": "TCP"}]


def _user_env(env: list[s.EnvVar]) -> list[dict[str, Any]]:
    return [e.model_dump(by_alias=True, exclude_none=True) for e in env]


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


def worker_capabilities(spec: s.DisaggregatedInferenceSpec) -> tuple[str, ...]:
    return (IPC_LOCK,) if spec.kv_transfer.rdma.enabled else ()


def _serving_probes() -> dict[str, Any]:
    """The probes of the container owning the pod's HTTP port. Loading weights can take long: the startup probe
    holds liveness off until /health answers. A terminating vLLM pod turns the pd-proxy's /ready 503 as our
    worker's does."""
    return {"startupProbe": http_probe("/health", 10, 180), "livenessProbe": http_probe("/health", 10, 3),
            "readinessProbe": http_probe("/ready", 5, 2)}


def _pre_stop(r: s.RoleSpec) -> dict[str, Any]:
    """The router stops sending (/ready turns false on SIGTERM) before SIGTERM: a preStop wait."""
    if not r.drain_delay_seconds:
        return {}
    return {"lifecycle": {"preStop": {"exec": {"command": ["sleep", str(r.drain_delay_seconds)]}}}}


def _engine_container(owner: Owner, spec: s.DisaggregatedInferenceSpec, role: Role,
                      mounts: list[dict[str, Any]]) -> dict[str, Any]:
    """Our worker (the pod's HTTP port, its probes, the hand-off key) or vLLM (on the pod's loopback)."""
    r: s.RoleSpec = getattr(spec, role)
    command = pod_worker_command(spec, role, namespace=owner.namespace, instance=owner.name)
    rdma = spec.kv_transfer.rdma
    devices = {"nvidia.com/gpu": s.worker_gpus(spec, role)}
    if rdma.enabled and rdma.resource_name:
        devices[rdma.resource_name] = 1
    vllm = spec.engine == "vllm"
    engine_env = [{"name": k, "value": v} for k, v in {**command.env, **(VLLM_POD_ENV if vllm else {})}.items()]
    http = [] if vllm else [{"name": "http", "containerPort": HTTP_PORT, "protocol": "TCP"}]
    container: dict[str, Any] = {
        "name": role, "image": worker_image(spec), "command": command.argv[:1], "args": command.argv[1:],
        "ports": [*http, {"name": "kv-side-channel", "containerPort": SIDE_CHANNEL_PORT, "protocol": "TCP"},
                  *_kv_events_ports(spec)],
        "env": downward_env() + engine_env + ([] if vllm else handoff_env(owner, spec)) + _user_env(r.env),
        "resources": resources(r.resources, devices),
        "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}, tmp_volume()[1], *mounts],
        **({} if vllm else _serving_probes()),
        "securityContext": container_security_context(worker_capabilities(spec)),
        **_pre_stop(r),
    }
    if spec.image_pull_policy:
        container["imagePullPolicy"] = spec.image_pull_policy
    return container


def _pd_proxy_container(owner: Owner, spec: s.DisaggregatedInferenceSpec, role: Role) -> dict[str, Any]:
    """engine vllm: `disagg pd-proxy` owns the pod's HTTP port (the router and the gateway talk to it) and its
    probes; it signs and checks hand-offs, so it gets the key."""
    argv = pod_pd_proxy_command(spec, role, namespace=owner.namespace, instance=owner.name)
    container: dict[str, Any] = {
        "name": PD_PROXY, "image": spec.image, "command": argv[:1], "args": argv[1:],
        "ports": [{"name": "http", "containerPort": HTTP_PORT, "protocol": "TCP"}],
        "env": downward_env() + handoff_env(owner, spec),
        **_serving_probes(),
        "securityContext": container_security_context(),
        "volumeMounts": [tmp_volume()[1]],
        **_pre_stop(getattr(spec, role)),
    }
    if spec.image_pull_policy:
        container["imagePullPolicy"] = spec.image_pull_policy
    return container


def build_worker_deployment(owner: Owner, spec: s.DisaggregatedInferenceSpec, role: Role) -> dict[str, Any]:
    r: s.RoleSpec = getattr(spec, role)
    volumes, mounts = _model_volumes(spec)
    tmp, tmp_mount = tmp_volume()
    shm: dict[str, Any] = {"medium": "Memory"}
    if r.shared_memory_size is not None:
        shm["sizeLimit"] = str(r.shared_memory_size)
    containers = [_engine_container(owner, spec, role, mounts)]
    if spec.engine == "vllm":
        containers.append(_pd_proxy_container(owner, spec, role))
    pod_spec: dict[str, Any] = {
        # behind a gateway decode pods list the prefill pods their own hop may go to
        **({"serviceAccountName": child_name(owner.name, "worker")}
           if role == "decode" and spec.gateway.enabled else {}),
        "securityContext": pod_security_context(),
        **({"initContainers": [_fetch_init_container(spec, tmp_mount)]} if spec.model.source.downloaded else {}),
        "containers": containers,
        "volumes": [{"name": "dshm", "emptyDir": shm}, tmp, *volumes],
        "terminationGracePeriodSeconds": r.termination_grace_period_seconds,
        **scheduling(r),
    }
    if spec.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": n} for n in spec.image_pull_secrets]
    labels = {**common_labels(owner.name, role), LABEL_REVISION: serving_revision(spec)}
    return {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": metadata(owner, child_name(owner.name, role), role),
        "spec": {"replicas": r.replicas, "selector": {"matchLabels": selector_labels(owner.name, role)},
                 "template": pod_template(labels, pod_spec)},
    }


# ---------------------------------------------------------------- router
ROUTER_PRESTOP_S = 5  # the router pod's preStop sleep: endpoint removal reaches kube-proxy and gateways meanwhile
ROUTER_GRACE_MARGIN_S = 5


def router_grace_s(argv: list[str]) -> int:
    """The router pod's grace period: the preStop sleep, then the router's --drain-delay and --drain-timeout (its
    own flags: extraArgs may set them, the last wins) and the cut's grace, and a margin."""
    drain = {"--drain-delay": DRAIN_DELAY_S, "--drain-timeout": DRAIN_TIMEOUT_S}
    for flag, value in zip(argv, argv[1:]):
        if flag in drain and value.replace(".", "", 1).isdigit():
            drain[flag] = float(value)
    return ROUTER_PRESTOP_S + math.ceil(sum(drain.values()) + CUT_GRACE_S) + ROUTER_GRACE_MARGIN_S


def build_router_deployment(owner: Owner, spec: s.DisaggregatedInferenceSpec) -> dict[str, Any]:
    tmp, tmp_mount = tmp_volume()
    argv = pod_router_command(spec, namespace=owner.namespace, instance=owner.name)
    tls = spec.router.tls
    scheme = "HTTPS" if tls else "HTTP"
    container: dict[str, Any] = {
        "name": "router", "image": spec.image, "command": argv[:1], "args": argv[1:],
        "ports": [{"name": "http", "containerPort": HTTP_PORT, "protocol": "TCP"}],
        "env": downward_env() + client_key_env(spec.router),
        "resources": resources(spec.router.resources),
        # liveness only once /health first answered: on a node busy starting the workers beside it (each loading
        # torch and its weights) the router's own start-up can outlast liveness's 3 failures, and a restart then
        # drops the requests a held burst brought
        "startupProbe": http_probe("/health", 5, 24, scheme),
        "livenessProbe": http_probe("/health", 10, 3, scheme),
        "readinessProbe": http_probe("/ready", 5, 2, scheme),  # 503 until the router sees a decode endpoint
        "securityContext": container_security_context(),  # moves HTTP only: never IPC_LOCK
        "volumeMounts": [tmp_mount, *([{"name": "tls", "mountPath": TLS_DIR, "readOnly": True}] if tls else [])],
        # the Service drops the terminating pod while this sleeps; then SIGTERM: /ready 503 for --drain-delay,
        # the listener closes, open requests get --drain-timeout (worker/router/draining.py)
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(ROUTER_PRESTOP_S)]}}},
    }
    volumes = [tmp, *([{"name": "tls", "secret": {"secretName": tls.secret_name}}] if tls else [])]
    pod_spec: dict[str, Any] = {"serviceAccountName": child_name(owner.name, "router"),
                                "securityContext": pod_security_context(), "containers": [container],
                                "volumes": volumes, **scheduling(spec.router),
                                # longer than everything above, so that no stream is cut by a SIGKILL
                                "terminationGracePeriodSeconds": router_grace_s(argv)}
    pull_fields(spec, container, pod_spec)
    return {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": metadata(owner, child_name(owner.name, "router"), "router"),
        "spec": {"replicas": spec.router.replicas, "selector": {"matchLabels": selector_labels(owner.name, "router")},
                 "template": pod_template(common_labels(owner.name, "router"), pod_spec)},
    }


def build_router_service(owner: Owner, spec: s.DisaggregatedInferenceSpec) -> dict[str, Any]:
    return {
        "apiVersion": "v1", "kind": "Service",
        "metadata": metadata(owner, owner.name, "router"),
        "spec": {"type": spec.router.service.type, "selector": selector_labels(owner.name, "router"),
                 "ports": [{"name": "http", "port": spec.router.service.port, "targetPort": "http",
                            "protocol": "TCP"}]},
    }


def build_headless_service(owner: Owner, role: Role) -> dict[str, Any]:
    return {
        "apiVersion": "v1", "kind": "Service",
        "metadata": metadata(owner, child_name(owner.name, role), role),
        "spec": {"clusterIP": "None", "selector": selector_labels(owner.name, role),
                 "ports": [{"name": "http", "port": HTTP_PORT, "targetPort": "http", "protocol": "TCP"},
                           {"name": "kv-side-channel", "port": SIDE_CHANNEL_PORT, "targetPort": "kv-side-channel",
                            "protocol": "TCP"}]},
    }


def build_router_rbac(owner: Owner) -> list[dict[str, Any]]:
    return pod_reader_rbac(owner, "router")


def build_worker_rbac(owner: Owner, spec: s.DisaggregatedInferenceSpec) -> list[dict[str, Any]]:
    """Behind a gateway: the decode pods' identity (they discover the prefill pods their hop may go to)."""
    return pod_reader_rbac(owner, "worker") if spec.gateway.enabled else []


# ---------------------------------------------------------------- everything
def desired_children(owner: Owner, spec: s.DisaggregatedInferenceSpec) -> list[dict[str, Any]]:
    """Order matters: NetworkPolicies, RBAC and Services before the Deployments that use them; the gateway's
    children last (the pool names the picker's Service)."""
    return [*build_network_policies(owner, spec), *build_router_rbac(owner), *build_worker_rbac(owner, spec),
            build_headless_service(owner, "prefill"), build_headless_service(owner, "decode"),
            build_router_service(owner, spec),
            build_worker_deployment(owner, spec, "prefill"), build_worker_deployment(owner, spec, "decode"),
            build_router_deployment(owner, spec), *gateway_children(owner, spec)]


def possible_children(owner: Owner, spec: s.DisaggregatedInferenceSpec) -> list[tuple[str, str, str]]:
    """(apiVersion, kind, name) of every child this resource may have, whatever its optional parts: what the
    reconcile pass removes when the spec no longer wants it."""
    everything = spec.model_copy(deep=True)
    everything.gateway.enabled = True
    everything.gateway.http_route = s.HTTPRouteSpec(gateway_name="any")
    everything.security.network_policy.enabled = True
    return [(c["apiVersion"], c["kind"], c["metadata"]["name"]) for c in desired_children(owner, everything)]
