"""Pure functions: the children spec.gateway adds (Gateway API Inference Extension v1). No API calls.

  InferencePool N (inference.networking.k8s.io/v1): the decode pods, their HTTP port, the picker's Service;
  Deployment + Service N-epp: `disagg epp`, the endpoint picker the gateway calls (ext_proc over gRPC), with
    ServiceAccount/Role/RoleBinding N-epp (it lists the resource's pods as the router does);
  HTTPRoute N (gateway.networking.k8s.io/v1, spec.gateway.httpRoute): the user's Gateway -> the pool.
"""
from __future__ import annotations

from typing import Any

from disagg.operator import spec as s
from disagg.operator.naming import (
    EPP_GRPC_PORT, EPP_HEALTH_PORT, EPP_METRICS_PORT, HTTP_PORT, child_name, common_labels, selector_labels,
)
from disagg.operator.plan import pod_epp_command
from disagg.operator.pod_parts import (
    Owner, client_key_env, container_security_context, downward_env, grpc_probe, metadata, pod_reader_rbac,
    pod_security_context, pod_template, pull_fields, resources, tmp_volume,
)

INFERENCE_GROUP = "inference.networking.k8s.io"
INFERENCE_POOL_API = f"{INFERENCE_GROUP}/v1"
GATEWAY_GROUP = "gateway.networking.k8s.io"
HTTP_ROUTE_API = f"{GATEWAY_GROUP}/v1"
# the picker's gRPC health service names (disagg epp serves both) Kubernetes' probes ask for
LIVENESS_SERVICE, READINESS_SERVICE = "liveness", "readiness"


def build_inference_pool(owner: Owner, spec: s.DisaggregatedInferenceSpec) -> dict[str, Any]:
    """The decode pods as the gateway's pool: it sends each request to the one the picker names (and, with
    FailOpen and the picker unreachable, to any of them: decode alone)."""
    return {
        "apiVersion": INFERENCE_POOL_API, "kind": "InferencePool",
        "metadata": metadata(owner, owner.name, "gateway"),
        "spec": {"selector": {"matchLabels": selector_labels(owner.name, "decode")},
                 "targetPorts": [{"number": HTTP_PORT}],
                 "endpointPickerRef": {"group": "", "kind": "Service", "name": child_name(owner.name, "epp"),
                                       "port": {"number": EPP_GRPC_PORT},
                                       "failureMode": spec.gateway.failure_mode}},
    }


def build_epp_deployment(owner: Owner, spec: s.DisaggregatedInferenceSpec) -> dict[str, Any]:
    tmp, tmp_mount = tmp_volume()
    argv = pod_epp_command(spec, namespace=owner.namespace, instance=owner.name)
    picker = spec.gateway.endpoint_picker
    container: dict[str, Any] = {
        "name": "epp", "image": spec.image, "command": argv[:1], "args": argv[1:],
        "ports": [{"name": "grpc", "containerPort": EPP_GRPC_PORT, "protocol": "TCP"},
                  {"name": "grpc-health", "containerPort": EPP_HEALTH_PORT, "protocol": "TCP"},
                  {"name": "metrics", "containerPort": EPP_METRICS_PORT, "protocol": "TCP"}],
        "env": downward_env() + client_key_env(spec.router),  # the router's client keys at this front door too
        "resources": resources(picker.resources),
        "startupProbe": grpc_probe(EPP_HEALTH_PORT, LIVENESS_SERVICE, 5, 24),  # as the router's: start-up first
        "livenessProbe": grpc_probe(EPP_HEALTH_PORT, LIVENESS_SERVICE, 10, 3),
        "readinessProbe": grpc_probe(EPP_HEALTH_PORT, READINESS_SERVICE, 5, 2),  # NOT_SERVING while draining
        "securityContext": container_security_context(),
        "volumeMounts": [tmp_mount],
    }
    name = child_name(owner.name, "epp")
    pod_spec: dict[str, Any] = {"serviceAccountName": name, "securityContext": pod_security_context(),
                                "containers": [container], "volumes": [tmp]}
    pull_fields(spec, container, pod_spec)
    return {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": metadata(owner, name, "epp"),
        "spec": {"replicas": picker.replicas, "selector": {"matchLabels": selector_labels(owner.name, "epp")},
                 "template": pod_template(common_labels(owner.name, "epp"), pod_spec)},
    }


def build_epp_service(owner: Owner) -> dict[str, Any]:
    """What the pool's endpointPickerRef names: ext_proc is HTTP/2 (appProtocol tells the gateway so)."""
    return {
        "apiVersion": "v1", "kind": "Service", "metadata": metadata(owner, child_name(owner.name, "epp"), "epp"),
        "spec": {"type": "ClusterIP", "selector": selector_labels(owner.name, "epp"), "ports": [
            {"name": "grpc", "port": EPP_GRPC_PORT, "targetPort": "grpc", "protocol": "TCP",
             "appProtocol": "http2"},
            {"name": "grpc-health", "port": EPP_HEALTH_PORT, "targetPort": "grpc-health", "protocol": "TCP"},
            {"name": "metrics", "port": EPP_METRICS_PORT, "targetPort": "metrics", "protocol": "TCP"}]},
    }


def build_http_route(owner: Owner, route: s.HTTPRouteSpec) -> dict[str, Any]:
    """The user's Gateway -> the pool. No port on the backendRef: an InferencePool's port is its targetPorts
    (GIE requires it left out)."""
    parent: dict[str, Any] = {"group": GATEWAY_GROUP, "kind": "Gateway", "name": route.gateway_name}
    if route.gateway_namespace:
        parent["namespace"] = route.gateway_namespace
    if route.section_name:
        parent["sectionName"] = route.section_name
    spec: dict[str, Any] = {
        "parentRefs": [parent],
        "rules": [{"matches": [{"path": {"type": "PathPrefix", "value": route.path_prefix}}],
                   "backendRefs": [{"group": INFERENCE_GROUP, "kind": "InferencePool", "name": owner.name}]}],
    }
    if route.hostnames:
        spec["hostnames"] = list(route.hostnames)
    return {"apiVersion": HTTP_ROUTE_API, "kind": "HTTPRoute", "metadata": metadata(owner, owner.name, "gateway"),
            "spec": spec}


def gateway_children(owner: Owner, spec: s.DisaggregatedInferenceSpec) -> list[dict[str, Any]]:
    """Everything spec.gateway adds; none when it is off. RBAC and the Service before the Deployment."""
    if not spec.gateway.enabled:
        return []
    route = spec.gateway.http_route
    return [*pod_reader_rbac(owner, "epp"), build_epp_service(owner), build_epp_deployment(owner, spec),
            build_inference_pool(owner, spec), *([build_http_route(owner, route)] if route else [])]
