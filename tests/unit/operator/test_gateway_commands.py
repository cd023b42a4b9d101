"""Contract: every command the gateway adds to a resource's pods parses with its program's own parser
(`disagg.worker.cli.build_parser`, after Kubernetes' $(VAR) expansion) and says what the spec says:
`disagg epp` (epp_command.py), `disagg pd-proxy` in every vLLM pod (pd_proxy_command.py), and the decode
worker's prefill-hop allowlist (`--pd-*`, worker_command.py)."""
from __future__ import annotations

import argparse
import copy
import itertools
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from disagg.operator import manifests as m
from disagg.operator import naming
from disagg.operator import spec as s
from disagg.operator import validate
from disagg.worker.cli import build_parser
from test_router_command import POLICIES, ROUTERS  # the router's variants: the picker routes by the same spec

ROOT = Path(__file__).resolve().parents[3]
BASES = {engine: yaml.safe_load((ROOT / "examples" / f"llama3-8b-{name}.yaml").read_text())
         for engine, name in (("disagg", "gpu"), ("vllm", "vllm"))}
OWNER = m.Owner(name="llama", namespace="serving", uid="0000-1111")
POD_ENV = {"POD_IP": "10.1.2.3", "POD_NAME": "p", "POD_NAMESPACE": "serving"}
GATEWAYS = {
    "off": {"enabled": False},
    "fail-close": {"enabled": True},
    "fail-open-route": {"enabled": True, "failureMode": "FailOpen",
                        "endpointPicker": {"replicas": 2, "extraArgs": ["--log-level", "DEBUG"]},
                        "httpRoute": {"gatewayName": "inference-gw"}},
}
VARIANTS = list(itertools.product(BASES, POLICIES, ROUTERS, GATEWAYS))


class _Rejected(Exception):
    pass


class _RaisingParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise _Rejected(message)


def parse_like_the_pod(container: dict[str, Any]) -> argparse.Namespace:
    argv = [*container["command"], *container["args"]]
    assert argv[0] == "disagg", argv
    expanded = [re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda mo: POD_ENV.get(mo.group(1), mo.group(0)), a)
                for a in argv[1:]]
    assert not any("$(" in a for a in expanded), expanded
    return build_parser(expanded, _RaisingParser).parse_args(expanded)


def document(engine: str, policy: str, router: str, gateway: str) -> dict[str, Any]:
    doc = copy.deepcopy(BASES[engine])
    doc["spec"]["router"] = {**doc["spec"].get("router", {}), **copy.deepcopy(ROUTERS[router]), "policy": policy}
    doc["spec"]["gateway"] = copy.deepcopy(GATEWAYS[gateway])
    return doc


def pod_containers(doc: dict[str, Any], deployment: str) -> dict[str, dict[str, Any]]:
    spec = s.parse_spec(doc["spec"])
    dep = next(c for c in m.desired_children(OWNER, spec)
               if c["kind"] == "Deployment" and c["metadata"]["name"] == deployment)
    return {c["name"]: c for c in dep["spec"]["template"]["spec"]["containers"]}


def check_bounds(args: argparse.Namespace, spec: s.DisaggregatedInferenceSpec) -> None:
    t = spec.router.timeouts
    assert (args.connect_timeout, args.first_byte_timeout, args.idle_timeout, args.request_timeout) == (
        t.connect_seconds, t.first_byte_seconds, t.idle_seconds, t.request_seconds)
    assert args.unresponsive_after == t.unresponsive_after(spec.engine)


@pytest.mark.parametrize("engine, policy, router, gateway", VARIANTS, ids=["-".join(v) for v in VARIANTS])
def test_every_gateway_command_parses_with_its_programs_parser(engine, policy, router, gateway):
    doc = document(engine, policy, router, gateway)
    assert validate.validate_document(doc) == []
    spec = s.parse_spec(doc["spec"])
    on = spec.gateway.enabled
    prefill_selector = naming.label_selector(OWNER.name, "prefill")
    names = {c["metadata"]["name"] for c in m.desired_children(OWNER, spec) if c["kind"] == "Deployment"}
    assert ("llama-epp" in names) is on
    if on:
        args = parse_like_the_pod(pod_containers(doc, "llama-epp")["epp"])
        assert args.command == "epp" and args.policy == policy
        assert (args.host, args.grpc_port, args.health_port, args.metrics_port) == (
            "0.0.0.0", naming.EPP_GRPC_PORT, naming.EPP_HEALTH_PORT, naming.EPP_METRICS_PORT)
        assert (args.discovery, args.namespace, args.prefill_selector, args.decode_selector) == (
            "kubernetes", OWNER.namespace, prefill_selector, naming.label_selector(OWNER.name, "decode"))
        check_bounds(args, spec)
        o, x = spec.router.outlier_detection, spec.router.prefix_aware
        assert (args.eject_after_failures, args.ejection_seconds, args.max_ejection_seconds) == (
            o.consecutive_failures, o.base_ejection_seconds, o.max_ejection_seconds)
        assert (args.prefix_load_cost_tokens, args.prefix_skip_prefill_blocks) == (
            x.load_cost_tokens, x.skip_prefill_blocks)
        assert (args.kv_events_port, args.kv_events_replay_port) == (
            naming.KV_EVENTS_PORTS if policy == "prefix-aware" else (None, None))
        assert args.log_level == ("DEBUG" if gateway == "fail-open-route" else "INFO")
        # spec.router.auth: the router's client key at this front door too
        env = {e["name"]: e for e in pod_containers(doc, "llama-epp")["epp"]["env"]}
        assert ("DISAGG_API_KEY" in env) is (router == "auth-tls")
    for role in ("prefill", "decode"):
        containers = pod_containers(doc, f"llama-{role}")
        hop = on and role == "decode"  # behind a gateway the decode side runs the prefill hop itself
        if engine == "disagg":
            assert set(containers) == {role}
            args = parse_like_the_pod(containers[role])
            assert args.command == "worker"
            assert (args.pd_discovery, args.pd_namespace, args.pd_prefill_selector, args.pd_worker_port) == (
                ("kubernetes", OWNER.namespace, prefill_selector, naming.HTTP_PORT) if hop
                else ("none", "default", None, naming.HTTP_PORT))
            continue
        assert set(containers) == {role, m.PD_PROXY}
        proxy = containers[m.PD_PROXY]
        args = parse_like_the_pod(proxy)
        assert args.command == "pd-proxy" and args.role == role
        assert (args.host, args.port) == ("0.0.0.0", naming.HTTP_PORT)
        vllm = containers[role]["args"]
        vllm_url = f"http://{vllm[vllm.index('--host') + 1]}:{vllm[vllm.index('--port') + 1]}"
        assert args.engine_url == vllm_url == f"http://127.0.0.1:{naming.ENGINE_PORT}"
        assert args.kv_lease_seconds == spec.kv_transfer.lease_seconds
        assert 1 <= args.drain_timeout == s.request_drain_seconds(spec, role)
        check_bounds(args, spec)
        assert (args.discovery, args.namespace, args.prefill_selector) == (
            ("kubernetes", OWNER.namespace, prefill_selector) if hop else ("static", "default", None))
        assert proxy["image"] == spec.image
        assert proxy["ports"] == [{"name": "http", "containerPort": naming.HTTP_PORT, "protocol": "TCP"}]
        assert {k: proxy[k]["httpGet"]["path"] for k in ("startupProbe", "livenessProbe", "readinessProbe")} == {
            "startupProbe": "/health", "livenessProbe": "/health", "readinessProbe": "/ready"}


def test_an_endpoint_picker_flag_the_operator_sets_is_rejected_by_name():
    doc = document("disagg", "least-loaded", "defaults", "fail-close")
    doc["spec"]["gateway"]["endpointPicker"] = {"extraArgs": ["--grpc-port=9100"]}
    assert [p.path for p in validate.validate_document(doc)] == ["spec.gateway.endpointPicker.extraArgs"]


def test_a_decode_flag_of_the_prefill_hop_is_the_operators_behind_a_gateway():
    doc = document("disagg", "least-loaded", "defaults", "fail-close")
    doc["spec"]["decode"]["extraArgs"] = ["--pd-discovery", "static"]
    assert [p.path for p in validate.validate_document(doc)] == ["spec.decode.extraArgs"]


def test_an_http_route_without_the_gateway_is_rejected_by_name():
    doc = document("disagg", "least-loaded", "defaults", "off")
    doc["spec"]["gateway"]["httpRoute"] = {"gatewayName": "gw"}
    assert [p.path for p in validate.validate_document(doc)] == ["spec.gateway.httpRoute"]
