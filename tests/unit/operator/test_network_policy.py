"""The rendered NetworkPolicies admit exactly what they claim: a small evaluator of NetworkPolicy ingress semantics
(test code: pod isolation, peers with podSelector/namespaceSelector and matchLabels/matchExpressions, ports with
endPort) runs every rendered policy against the pods the resource's Deployments create (their template labels and
container ports) and pods around them - the user's gateway, the operator, a stranger in the same namespace,
another resource's decode pod - and the test lists every allowed (from, to, port)."""
from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from disagg.operator import manifests as m
from disagg.operator import naming
from disagg.operator import spec as s

ROOT = Path(__file__).resolve().parents[3]
BASES = {engine: yaml.safe_load((ROOT / "examples" / f"llama3-8b-{name}.yaml").read_text())["spec"]
         for engine, name in (("disagg", "gpu"), ("vllm", "vllm"))}
NS = "serving"
OWNER = m.Owner(name="llama", namespace=NS, uid="0000-1111")
EPHEMERAL, SSH = 40000, 22  # a port UCX's TCP data connections land on; one nothing should reach


@dataclass(frozen=True)
class Pod:
    name: str
    namespace: str
    labels: dict[str, str] = field(hash=False)
    ports: frozenset[int] = frozenset()


# ---------------------------------------------------------------- the evaluator
def selects(selector: dict[str, Any] | None, labels: dict[str, str]) -> bool:
    """A LabelSelector; {} (or None where the field is required) selects everything."""
    selector = selector or {}
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for e in selector.get("matchExpressions") or []:
        key, op, values = e["key"], e["operator"], e.get("values") or []
        ok = {"In": key in labels and labels[key] in values, "NotIn": labels.get(key) not in values,
              "Exists": key in labels, "DoesNotExist": key not in labels}[op]
        if not ok:
            return False
    return True


def peer_admits(peer: dict[str, Any], policy_ns: str, src: Pod, namespaces: dict[str, dict[str, str]]) -> bool:
    assert "ipBlock" not in peer, "pods only here"
    if "namespaceSelector" in peer:
        in_ns = selects(peer["namespaceSelector"], namespaces[src.namespace])
    else:
        in_ns = src.namespace == policy_ns
    return in_ns and ("podSelector" not in peer or selects(peer["podSelector"], src.labels))


def port_admits(ports: list[dict[str, Any]] | None, port: int) -> bool:
    if not ports:
        return True
    for p in ports:
        assert p.get("protocol", "TCP") == "TCP" and isinstance(p.get("port"), int), p
        if p["port"] <= port <= p.get("endPort", p["port"]):
            return True
    return False


def allowed(policies: list[dict[str, Any]], src: Pod, dst: Pod, port: int,
            namespaces: dict[str, dict[str, str]]) -> bool:
    selecting = [p for p in policies if p["metadata"]["namespace"] == dst.namespace
                 and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])
                 and selects(p["spec"]["podSelector"], dst.labels)]
    if not selecting:
        return True  # not isolated
    return any(port_admits(rule.get("ports"), port)
               and (not rule.get("from") or any(peer_admits(peer, p["metadata"]["namespace"], src, namespaces)
                                                for peer in rule["from"]))
               for p in selecting for rule in p["spec"].get("ingress") or [])


# ---------------------------------------------------------------- the pods
NAMESPACES = {ns: {"kubernetes.io/metadata.name": ns} for ns in (NS, "gateways", "disagg-system", "team-b")}


def resource_pods(kids: list[dict[str, Any]]) -> list[Pod]:
    """One pod per Deployment, as its ReplicaSet creates them."""
    out = []
    for d in kids:
        if d["kind"] != "Deployment":
            continue
        template = d["spec"]["template"]
        ports = {p["containerPort"] for c in template["spec"]["containers"] for p in c.get("ports") or []}
        component = template["metadata"]["labels"][naming.LABEL_COMPONENT]
        out.append(Pod(component, NS, template["metadata"]["labels"], frozenset(ports)))
    return out


def around(spec: s.DisaggregatedInferenceSpec) -> list[Pod]:
    """Who else runs in the cluster; `other-decode` is another resource's decode pod in the same namespace."""
    other = m.Owner(name="other", namespace=NS, uid="2222")
    other_decode = next(p for p in resource_pods(m.desired_children(other, spec)) if p.name == "decode")
    return [Pod("gateway", "gateways", {"app": "envoy"}), Pod("operator", "disagg-system", {
                naming.LABEL_NAME: "disagg-operator", naming.LABEL_INSTANCE: "disagg-operator"}),
            Pod("stranger", NS, {"app": "curl"}), Pod("elsewhere", "team-b", {"app": "curl"}),
            Pod("other-decode", NS, other_decode.labels)]


def reachable(spec: s.DisaggregatedInferenceSpec) -> set[tuple[str, str, int]]:
    kids = m.desired_children(OWNER, spec)
    policies = [c for c in kids if c["kind"] == "NetworkPolicy"]
    ours = resource_pods(kids)
    sources = ours + around(spec)
    return {(src.name, dst.name, port) for dst in ours for port in sorted(dst.ports | {EPHEMERAL, SSH})
            for src in sources if src.name != dst.name and allowed(policies, src, dst, port, NAMESPACES)}


def spec_with(engine: str, **top: Any) -> s.DisaggregatedInferenceSpec:
    raw = copy.deepcopy(BASES[engine])
    raw.update(copy.deepcopy(top))
    return s.parse_spec(raw)


def pairs(sources: str, dst: str, *ports: int) -> set[tuple[str, str, int]]:
    return {(src, dst, port) for src, port in itertools.product(sources.split(), ports)}


EVERYONE = "router epp prefill decode gateway operator stranger elsewhere other-decode"
GATEWAYS_NS = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "gateways"}}}]
HTTP, SIDE, (EVENTS, REPLAY) = naming.HTTP_PORT, naming.SIDE_CHANNEL_PORT, naming.KV_EVENTS_PORTS


@pytest.mark.parametrize("engine", ["disagg", "vllm"])
def test_the_router_topology_admits_exactly_the_router_the_operator_and_the_kv_hand_off(engine):
    got = reachable(spec_with(engine))
    want = (pairs(EVERYONE.replace("epp ", "").replace("router ", ""), "router", HTTP)  # the front door
            | pairs("router operator", "prefill", HTTP) | pairs("router operator", "decode", HTTP)
            | pairs("decode", "prefill", SIDE, EPHEMERAL)  # NIXL: the side channel, UCX's data connections
            | pairs("prefill", "decode", EPHEMERAL))
    assert got == want, (sorted(got - want), sorted(want - got))


@pytest.mark.parametrize("engine", ["disagg", "vllm"])
def test_behind_a_named_gateway_with_prefix_aware_routing(engine):
    spec = spec_with(engine, router={"policy": "prefix-aware"}, gateway={"enabled": True},
                     security={"networkPolicy": {"gatewayFrom": GATEWAYS_NS}})
    got = reachable(spec)
    want = (pairs(EVERYONE.replace("router ", ""), "router", HTTP)
            | pairs("gateway", "epp", naming.EPP_GRPC_PORT, naming.EPP_HEALTH_PORT)
            | pairs("operator", "epp", naming.EPP_METRICS_PORT)
            | pairs("router epp operator decode", "prefill", HTTP)  # decode: its own prefill hop
            | pairs("router epp operator gateway", "decode", HTTP)
            | pairs("decode", "prefill", SIDE, EPHEMERAL) | pairs("prefill", "decode", EPHEMERAL)
            # KV events carry the prompts' token ids: only who routes subscribes
            | pairs("router epp", "prefill", EVENTS, REPLAY) | pairs("router epp", "decode", EVENTS, REPLAY))
    assert got == want, (sorted(got - want), sorted(want - got))


def test_the_default_gateway_peers_are_any_pod_and_an_empty_list_none():
    anyone = reachable(spec_with("disagg", gateway={"enabled": True}))
    to_decode = {src for src, dst, port in anyone if dst == "decode" and port == HTTP}
    assert to_decode == set(EVERYONE.split()) - {"decode"}  # the documented trade-off: any namespace
    assert {src for src, dst, port in anyone if dst == "epp" and port == naming.EPP_GRPC_PORT} == \
        set(EVERYONE.split()) - {"epp"}
    nobody = reachable(spec_with("disagg", gateway={"enabled": True},
                                 security={"networkPolicy": {"gatewayFrom": [], "metricsFrom": []}}))
    assert {src for src, dst, port in nobody if dst == "decode" and port == HTTP} == {"router", "epp"}
    assert not {p for p in nobody if p[1] == "epp"}  # an empty peer list admits none (never everyone)


def test_metrics_peers_replace_the_operator():
    prometheus = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "team-b"}}}]
    got = reachable(spec_with("disagg", security={"networkPolicy": {"metricsFrom": prometheus}}))
    assert {src for src, dst, port in got if dst == "prefill" and port == HTTP} == {"router", "elsewhere"}


def test_turned_off_there_is_no_policy():
    spec = spec_with("disagg", gateway={"enabled": True}, security={"networkPolicy": {"enabled": False}})
    assert not [c for c in m.desired_children(OWNER, spec) if c["kind"] == "NetworkPolicy"]


def test_the_evaluator_follows_kubernetes_semantics():
    pod = Pod("p", NS, {"a": "1"}, frozenset({80}))
    src = Pod("q", "team-b", {"b": "2"})

    def policy(*rules: dict[str, Any]) -> dict[str, Any]:
        return {"metadata": {"namespace": NS}, "spec": {"podSelector": {}, "policyTypes": ["Ingress"],
                                                          "ingress": list(rules)}}
    assert allowed([], src, pod, 80, NAMESPACES)  # no policy: not isolated
    assert not allowed([policy()], src, pod, 80, NAMESPACES)  # selected, no rule: nothing
    assert allowed([policy({})], src, pod, 80, NAMESPACES)  # a rule without from/ports: everything
    assert not allowed([policy({"from": [{"podSelector": {}}]})], src, pod, 80, NAMESPACES)  # own namespace only
    assert allowed([policy({"from": [{"namespaceSelector": {"matchExpressions": [
        {"key": "kubernetes.io/metadata.name", "operator": "In", "values": ["team-b"]}]}}]})], src, pod, 80,
        NAMESPACES)
    assert not allowed([policy({"ports": [{"protocol": "TCP", "port": 81, "endPort": 90}]})], src, pod, 80,
                       NAMESPACES)
