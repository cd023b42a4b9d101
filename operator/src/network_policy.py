"""Pure functions: the ingress NetworkPolicies of a resource's pods (spec.security.networkPolicy, on by default).
No API calls. One policy per pod kind, named as its Deployment; only ingress is restricted (egress stays open:
DNS, the API server, model downloads).

    router   HTTP          <- anywhere (the front door)
    epp      ext_proc, health <- gatewayFrom;  metrics <- metricsFrom
    decode   HTTP          <- router, epp, gatewayFrom (gateway on), metricsFrom
             NIXL data     <- prefill
    prefill  HTTP          <- router, epp, decode (gateway on: the decode side's prefill hop), metricsFrom
             side channel, NIXL data <- decode
    prefill, decode: KV events (router.policy prefix-aware) <- router, epp

NIXL moves KV over UCX, whose TCP connections use the kernel's ephemeral ports (net.ipv4.ip_local_port_range,
32768-60999 by default) between prefill and decode pods of this resource; RDMA traffic does not pass a
NetworkPolicy. Kubelet probes come from the node, which most network plugins let in regardless of policies.
"""
from __future__ import annotations

from typing import Any

from disagg.operator import spec as s
from disagg.operator.naming import (
    EPP_GRPC_PORT, EPP_HEALTH_PORT, EPP_METRICS_PORT, HTTP_PORT, KV_EVENTS_PORTS, LABEL_NAME,
    SIDE_CHANNEL_PORT, Component, child_name, selector_labels,
)
from disagg.operator.pod_parts import Owner, metadata

NIXL_DATA_PORTS = (32768, 60999)  # Linux's default ephemeral range: where UCX's TCP connections land
OPERATOR_APP_NAME = "disagg-operator"  # the chart's app.kubernetes.io/name: the autoscaler scrapes /metrics
ANY_NAMESPACE: list[dict[str, Any]] = [{"namespaceSelector": {}}]  # every pod of the cluster


def _pods(owner: Owner, component: Component) -> dict[str, Any]:
    """A peer: this resource's pods of one component (in its own namespace: no namespaceSelector)."""
    return {"podSelector": {"matchLabels": selector_labels(owner.name, component)}}


def _tcp(*ports: int) -> list[dict[str, Any]]:
    return [{"protocol": "TCP", "port": p} for p in ports]


def _nixl_data() -> list[dict[str, Any]]:
    return [{"protocol": "TCP", "port": NIXL_DATA_PORTS[0], "endPort": NIXL_DATA_PORTS[1]}]


def gateway_peers(policy: s.NetworkPolicySpec) -> list[dict[str, Any]]:
    """Where the user's gateway runs; default any namespace (README: the trade-off)."""
    if policy.gateway_from is None:
        return ANY_NAMESPACE
    return [p.model_dump(by_alias=True) for p in policy.gateway_from]


def metrics_peers(policy: s.NetworkPolicySpec) -> list[dict[str, Any]]:
    """Who scrapes the workers' /metrics; default the operator's pods (its autoscaler) in any namespace."""
    if policy.metrics_from is None:
        return [{"namespaceSelector": {}, "podSelector": {"matchLabels": {LABEL_NAME: OPERATOR_APP_NAME}}}]
    return [p.model_dump(by_alias=True) for p in policy.metrics_from]


def _policy(owner: Owner, component: Component, rules: list[dict[str, Any]]) -> dict[str, Any]:
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": metadata(owner, child_name(owner.name, component), component),
            "spec": {"podSelector": {"matchLabels": selector_labels(owner.name, component)},
                     # a rule whose `from` is empty would admit every source: a peer list given as [] admits none
                     "policyTypes": ["Ingress"], "ingress": [r for r in rules if r.get("from") != []]}}


def _worker_rules(owner: Owner, spec: s.DisaggregatedInferenceSpec, role: str) -> list[dict[str, Any]]:
    gateway = spec.gateway.enabled
    policy = spec.security.network_policy
    routers = [_pods(owner, "router"), *([_pods(owner, "epp")] if gateway else [])]
    http = [*routers, *metrics_peers(policy)]
    if role == "decode":
        http += gateway_peers(policy) if gateway else []
        kv = [{"from": [_pods(owner, "prefill")], "ports": _nixl_data()}]
    else:
        http += [_pods(owner, "decode")] if gateway else []
        kv = [{"from": [_pods(owner, "decode")], "ports": [*_tcp(SIDE_CHANNEL_PORT), *_nixl_data()]}]
    rules = [{"from": http, "ports": _tcp(HTTP_PORT)}, *kv]
    if spec.router.policy == "prefix-aware":  # the events carry the prompts' token ids: only who routes
        rules.append({"from": routers, "ports": _tcp(*KV_EVENTS_PORTS)})
    return rules


def build_network_policies(owner: Owner, spec: s.DisaggregatedInferenceSpec) -> list[dict[str, Any]]:
    """None when spec.security.networkPolicy.enabled is false."""
    policy = spec.security.network_policy
    if not policy.enabled:
        return []
    out = [_policy(owner, role, _worker_rules(owner, spec, role)) for role in ("prefill", "decode")]
    out.append(_policy(owner, "router", [{"ports": _tcp(HTTP_PORT)}]))  # no `from`: every source
    if spec.gateway.enabled:
        out.append(_policy(owner, "epp", [{"from": gateway_peers(policy), "ports": _tcp(EPP_GRPC_PORT,
                                                                                       EPP_HEALTH_PORT)},
                                          {"from": metrics_peers(policy), "ports": _tcp(EPP_METRICS_PORT)}]))
    return out
