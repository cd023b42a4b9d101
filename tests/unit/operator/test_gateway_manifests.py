"""What spec.gateway and spec.security add to a resource's children: the InferencePool (checked against GIE
v1.0.0's CRD schema, a fixture), the endpoint picker's Deployment/Service/RBAC, the HTTPRoute, the decode pods'
identity, the hand-off key's Secret and environment, and vLLM pods' pd-proxy container."""
from __future__ import annotations

import base64
import copy
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from openapi_schema_validator import OAS30Validator

from disagg.operator import gateway_manifests as g
from disagg.operator import handoff_key
from disagg.operator import manifests as m
from disagg.operator import naming
from disagg.operator import spec as s
from disagg.worker.kv_transfer.handoff_auth import HandoffSigner, decode_key, new_key, signer_from_env

ROOT = Path(__file__).resolve().parents[3]
POOL_CRD = ROOT / "tests" / "fixtures" / "gateway-api-inference-extension" / "inferencepools.yaml"
BASES = {engine: yaml.safe_load((ROOT / "examples" / f"llama3-8b-{name}.yaml").read_text())["spec"]
         for engine, name in (("disagg", "gpu"), ("vllm", "vllm"))}
OWNER = m.Owner(name="llama", namespace="serving", uid="0000-1111")
ROUTE = {"gatewayName": "inference-gw", "gatewayNamespace": "gateways", "sectionName": "https",
         "hostnames": ["llm.example.com"], "pathPrefix": "/v1"}


def spec_with(engine: str = "disagg", **top: Any) -> s.DisaggregatedInferenceSpec:
    raw = copy.deepcopy(BASES[engine])
    raw.update(copy.deepcopy(top))
    return s.parse_spec(raw)


def children(spec: s.DisaggregatedInferenceSpec) -> dict[tuple[str, str], dict[str, Any]]:
    return {(c["kind"], c["metadata"]["name"]): c for c in m.desired_children(OWNER, spec)}


def pool_validator() -> OAS30Validator:
    crd = yaml.safe_load(POOL_CRD.read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return OAS30Validator(version["schema"]["openAPIV3Schema"])


@pytest.mark.parametrize("failure_mode", ["FailClose", "FailOpen"])
def test_the_inference_pool_selects_the_decode_pods_and_names_the_picker(failure_mode):
    spec = spec_with(gateway={"enabled": True, "failureMode": failure_mode})
    kids = children(spec)
    pool = kids[("InferencePool", "llama")]
    pool_validator().validate(pool)  # GIE v1's schema (OAS30Validator raises on the first violation)
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    decode_pods = kids[("Deployment", "llama-decode")]["spec"]["template"]["metadata"]["labels"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= decode_pods.items()
    prefill_pods = kids[("Deployment", "llama-prefill")]["spec"]["template"]["metadata"]["labels"]
    assert not pool["spec"]["selector"]["matchLabels"].items() <= prefill_pods.items()
    assert pool["spec"]["targetPorts"] == [{"number": naming.HTTP_PORT}]
    assert pool["spec"]["endpointPickerRef"] == {"group": "", "kind": "Service", "name": "llama-epp",
                                                 "port": {"number": naming.EPP_GRPC_PORT},
                                                 "failureMode": failure_mode}
    service = kids[("Service", "llama-epp")]
    grpc = next(p for p in service["spec"]["ports"] if p["port"] == naming.EPP_GRPC_PORT)
    assert grpc == {"name": "grpc", "port": 9002, "targetPort": "grpc", "protocol": "TCP", "appProtocol": "http2"}
    assert sorted(p["port"] for p in service["spec"]["ports"]) == [9002, 9003, 9090]
    epp_pods = kids[("Deployment", "llama-epp")]["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= epp_pods.items()


def test_the_schema_fixture_rejects_what_gie_rejects():
    pool = children(spec_with(gateway={"enabled": True}))[("InferencePool", "llama")]
    broken = copy.deepcopy(pool)
    broken["spec"]["endpointPickerRef"]["failureMode"] = "FailSometimes"
    assert list(pool_validator().iter_errors(broken))
    broken = copy.deepcopy(pool)
    broken["spec"]["targetPorts"] = []
    assert list(pool_validator().iter_errors(broken))


def test_the_endpoint_picker_runs_like_the_router():
    spec = spec_with(gateway={"enabled": True, "endpointPicker": {
        "replicas": 2, "resources": {"requests": {"cpu": 1}, "limits": {"memory": "1Gi"}}}})
    kids = children(spec)
    epp, router = kids[("Deployment", "llama-epp")], kids[("Deployment", "llama-router")]
    pod, router_pod = epp["spec"]["template"]["spec"], router["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert epp["spec"]["replicas"] == 2 and c["image"] == spec.image
    assert c["command"] == ["disagg"] and c["args"][0] == "epp"
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"grpc": 9002, "grpc-health": 9003,
                                                                   "metrics": 9090}
    assert c["livenessProbe"]["grpc"] == {"port": 9003, "service": "liveness"}
    assert c["startupProbe"]["grpc"] == c["livenessProbe"]["grpc"]  # liveness only once it has started
    assert c["readinessProbe"]["grpc"] == {"port": 9003, "service": "readiness"}
    assert c["resources"] == {"requests": {"cpu": "1"}, "limits": {"memory": "1Gi"}}
    assert pod["securityContext"] == router_pod["securityContext"]
    assert c["securityContext"] == router_pod["containers"][0]["securityContext"]
    assert pod["serviceAccountName"] == "llama-epp"
    role = kids[("Role", "llama-epp")]
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
    assert kids[("RoleBinding", "llama-epp")]["subjects"] == [
        {"kind": "ServiceAccount", "name": "llama-epp", "namespace": "serving"}]


def test_the_http_route_sends_the_users_gateway_to_the_pool():
    route = children(spec_with(gateway={"enabled": True, "httpRoute": ROUTE}))[("HTTPRoute", "llama")]
    assert route["apiVersion"] == "gateway.networking.k8s.io/v1"
    assert route["spec"]["parentRefs"] == [{"group": "gateway.networking.k8s.io", "kind": "Gateway",
                                            "name": "inference-gw", "namespace": "gateways",
                                            "sectionName": "https"}]
    assert route["spec"]["hostnames"] == ["llm.example.com"]
    (rule,) = route["spec"]["rules"]
    assert rule["matches"] == [{"path": {"type": "PathPrefix", "value": "/v1"}}]
    # GIE: an InferencePool backendRef carries no port (the pool's targetPorts are its port)
    assert rule["backendRefs"] == [{"group": "inference.networking.k8s.io", "kind": "InferencePool",
                                    "name": "llama"}]
    minimal = children(spec_with(gateway={"enabled": True, "httpRoute": {"gatewayName": "gw"}}))[
        ("HTTPRoute", "llama")]
    assert minimal["spec"]["parentRefs"] == [{"group": "gateway.networking.k8s.io", "kind": "Gateway",
                                              "name": "gw"}]
    assert "hostnames" not in minimal["spec"]
    assert minimal["spec"]["rules"][0]["matches"][0]["path"]["value"] == "/"


@pytest.mark.parametrize("engine", ["disagg", "vllm"])
def test_only_the_gateway_gives_decode_pods_an_identity_that_lists_pods(engine):
    off, on = children(spec_with(engine)), children(spec_with(engine, gateway={"enabled": True}))
    gateway_kinds = {"InferencePool", "HTTPRoute"}
    assert not [k for k in off if k[1] in ("llama-epp", "llama-worker") or k[0] in gateway_kinds]
    assert {k for k in on if k[1] == "llama-worker"} == {("ServiceAccount", "llama-worker"),
                                                         ("Role", "llama-worker"), ("RoleBinding", "llama-worker")}
    assert on[("Deployment", "llama-decode")]["spec"]["template"]["spec"]["serviceAccountName"] == "llama-worker"
    assert "serviceAccountName" not in on[("Deployment", "llama-prefill")]["spec"]["template"]["spec"]
    assert "serviceAccountName" not in off[("Deployment", "llama-decode")]["spec"]["template"]["spec"]
    assert ("HTTPRoute", "llama") not in on  # only with httpRoute


def _env(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container["env"]}


@pytest.mark.parametrize("engine, signers", [("disagg", ("{role}",)), ("vllm", (m.PD_PROXY,))])
@pytest.mark.parametrize("own_secret", [False, True])
def test_every_container_that_signs_or_checks_hand_offs_gets_the_key(engine, signers, own_secret):
    security = {"handoffKeySecret": {"name": "my-key", "key": "hmac"}} if own_secret else {}
    kids = children(spec_with(engine, security=security))
    want = {"name": "my-key", "key": "hmac"} if own_secret else {"name": "llama-handoff", "key": "key"}
    for role in ("prefill", "decode"):
        containers = {c["name"]: c for c in kids[("Deployment", f"llama-{role}")]["spec"]["template"]["spec"][
            "containers"]}
        keyed = {name for name, c in containers.items() if "DISAGG_HANDOFF_KEY" in _env(c)}
        assert keyed == {n.format(role=role) for n in signers}
        for name in keyed:
            env = _env(containers[name])
            assert env["DISAGG_HANDOFF_KEY"]["valueFrom"] == {"secretKeyRef": want}
            assert env["DISAGG_HANDOFF_RESOURCE"]["value"] == "serving/llama"
    assert not [k for k in kids if k[0] == "Secret"], "the Secret is reconcile's (a random key), not a manifest"


def test_the_operators_secret_holds_a_key_the_workers_accept():
    key = new_key()
    secret = handoff_key.build_handoff_secret(OWNER, key)
    assert (secret["metadata"]["name"], secret["type"]) == ("llama-handoff", "Opaque")
    assert secret["metadata"]["ownerReferences"] == [OWNER.reference()]
    value = base64.b64decode(secret["data"]["key"]).decode()  # what the kubelet puts in $DISAGG_HANDOFF_KEY
    signer = signer_from_env({"DISAGG_HANDOFF_KEY": value, "DISAGG_HANDOFF_RESOURCE": "serving/llama"})
    assert isinstance(signer, HandoffSigner) and signer.resource == "serving/llama"
    assert len(decode_key(value, "test")) >= 16


def test_vllm_pods_put_the_pd_proxy_in_front_of_vllm():
    spec = spec_with("vllm", router={"policy": "prefix-aware"})
    dep = children(spec)[("Deployment", "llama-decode")]
    pod = dep["spec"]["template"]["spec"]
    vllm, proxy = pod["containers"]
    assert (vllm["name"], proxy["name"]) == ("decode", m.PD_PROXY)
    assert vllm["image"] == spec.engine_image and proxy["image"] == spec.image
    # only the pd-proxy is reachable at the pod's HTTP port; vLLM's side channel and KV events at the pod IP
    assert [p["containerPort"] for p in proxy["ports"]] == [naming.HTTP_PORT]
    assert naming.HTTP_PORT not in [p["containerPort"] for p in vllm["ports"]]
    assert {p["containerPort"] for p in vllm["ports"]} == {naming.SIDE_CHANNEL_PORT, *naming.KV_EVENTS_PORTS}
    # both drain: the preStop wait, then SIGTERM; the GPUs are vLLM's
    assert vllm["lifecycle"] == proxy["lifecycle"]
    assert "nvidia.com/gpu" in vllm["resources"]["limits"] and "resources" not in proxy
    assert proxy["securityContext"]["readOnlyRootFilesystem"] is True
    assert {vm["mountPath"] for vm in proxy["volumeMounts"]} == {"/tmp"}


@pytest.mark.parametrize("engine", ["disagg", "vllm"])
def test_everything_on_validates_against_kubernetes_schemas(engine, tmp_path: Path):
    """The built-in kinds strictly against Kubernetes' schemas (InferencePool: GIE's, above; HTTPRoute: the
    Gateway API's is not bundled there)."""
    pytest.importorskip("kubernetes_validate")
    router = {"policy": "prefix-aware", "auth": {"secretName": "keys"}, "tls": {"secretName": "router-tls"}}
    spec = spec_with(engine, router=router, gateway={"enabled": True, "httpRoute": ROUTE},
                     security={"networkPolicy": {"gatewayFrom": [{"namespaceSelector": {"matchLabels": {
                         "kubernetes.io/metadata.name": "gateways"}}}]}})
    builtin = [c for c in m.desired_children(OWNER, spec) if c["kind"] not in ("InferencePool", "HTTPRoute")]
    builtin.append(handoff_key.build_handoff_secret(OWNER, new_key()))
    f = tmp_path / "children.yaml"
    f.write_text(yaml.safe_dump_all(builtin))
    out = subprocess.run([sys.executable, "-m", "kubernetes_validate", "--strict", "-k", "1.30.0", "--quiet",
                          str(f)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_possible_children_cover_every_optional_child():
    everything = spec_with("vllm", gateway={"enabled": True, "httpRoute": {"gatewayName": "gw"}})
    possible = {(k, n) for _, k, n in m.possible_children(OWNER, spec_with("disagg"))}
    assert set(children(everything)) <= possible
    assert g.INFERENCE_POOL_API == "inference.networking.k8s.io/v1"


def test_the_gateway_example_routes_the_named_gateway_to_a_pool_gie_accepts():
    doc = yaml.safe_load((ROOT / "examples" / "llama3-8b-gateway.yaml").read_text())
    owner = m.Owner(name=doc["metadata"]["name"], namespace="serving", uid="u")
    kids = {(c["kind"], c["metadata"]["name"]): c for c in m.desired_children(owner, s.parse_spec(doc["spec"]))}
    pool_validator().validate(kids[("InferencePool", "llama3-8b-gw")])
    route = kids[("HTTPRoute", "llama3-8b-gw")]
    assert route["spec"]["parentRefs"][0]["name"] == doc["spec"]["gateway"]["httpRoute"]["gatewayName"]
    assert route["spec"]["rules"][0]["backendRefs"][0]["name"] == "llama3-8b-gw"


def test_router_auth_and_tls_come_from_the_users_secrets():
    spec = spec_with(router={"auth": {"secretName": "client-keys", "key": "k"},
                             "tls": {"secretName": "router-tls"}})
    pod = children(spec)[("Deployment", "llama-router")]["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert _env(c)["DISAGG_API_KEY"]["valueFrom"] == {"secretKeyRef": {"name": "client-keys", "key": "k"}}
    assert {"name": "tls", "secret": {"secretName": "router-tls"}} in pod["volumes"]
    assert {"name": "tls", "mountPath": "/etc/disagg/tls", "readOnly": True} in c["volumeMounts"]
    args = c["args"]
    assert args[args.index("--tls-cert-file") + 1] == "/etc/disagg/tls/tls.crt"
    assert args[args.index("--tls-key-file") + 1] == "/etc/disagg/tls/tls.key"
    assert c["livenessProbe"]["httpGet"]["scheme"] == c["readinessProbe"]["httpGet"]["scheme"] == "HTTPS"
    assert m.router_endpoint(OWNER, spec) == "https://llama.serving.svc:8000"
    plain = children(spec_with())[("Deployment", "llama-router")]["spec"]["template"]["spec"]["containers"][0]
    assert "DISAGG_API_KEY" not in _env(plain) and "--tls-cert-file" not in plain["args"]
    assert "scheme" not in plain["livenessProbe"]["httpGet"]
