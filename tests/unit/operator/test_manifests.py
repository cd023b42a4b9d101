"""Table-driven tests of the pure manifest builders."""
from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from disagg.operator import manifests as m
from disagg.operator import spec as s
from disagg.operator import naming

ROOT = Path(__file__).resolve().parents[3]
BASE = yaml.safe_load((ROOT / "examples" / "llama3-8b-gpu.yaml").read_text())["spec"]
OWNER = m.Owner(name="llama", namespace="serving", uid="0000-1111")


def spec_with(**changes: Any) -> s.DisaggregatedInferenceSpec:
    raw = copy.deepcopy(BASE)
    for dotted, value in changes.items():
        node = raw
        *parents, last = dotted.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
    return s.parse_spec(raw)


def container(dep: dict[str, Any]) -> dict[str, Any]:
    return dep["spec"]["template"]["spec"]["containers"][0]


def arg(c: dict[str, Any], flag: str) -> str | None:
    args = c["args"]
    return args[args.index(flag) + 1] if flag in args else None


HF = {"huggingFace": {"repo": "Qwen/Qwen2.5-0.5B"}}
URI = {"uri": {"url": "s3://bucket/llama"}}


@pytest.mark.parametrize("source, model_arg, volume, mount, fetched", [
    ({"pvc": {"claimName": "models", "path": "llama"}}, "/models/llama", "persistentVolumeClaim", "/models", False),
    ({"pvc": {"claimName": "models"}}, "/models", "persistentVolumeClaim", "/models", False),
    (HF, "/cache/models/", "emptyDir", "/cache", True),
    (URI, "/cache/models/", "emptyDir", "/cache", True),
    ({"path": "/opt/model"}, "/opt/model", None, None, False),
])
def test_model_source(source, model_arg, volume, mount, fetched):
    dep = m.build_worker_deployment(OWNER, spec_with(**{"model.source": source}), "decode")
    pod, c = dep["spec"]["template"]["spec"], container(dep)
    assert arg(c, "--model").startswith(model_arg)
    volumes = [v for v in pod["volumes"] if v["name"] not in ("dshm", "tmp")]
    assert [next(k for k in v if k != "name") for v in volumes] == ([volume] if volume else [])
    assert [vm["mountPath"] for vm in c["volumeMounts"] if vm["name"] not in ("dshm", "tmp")] == \
        ([mount] if mount else [])
    init = pod.get("initContainers", [])
    assert [i["name"] for i in init] == (["fetch-model"] if fetched else [])
    if fetched:  # the init container fills exactly the directory the worker loads
        assert init[0]["args"][0] == "fetch-model" and init[0]["args"][-2:] == ["--dest", arg(c, "--model")]
        assert {vm["mountPath"] for vm in init[0]["volumeMounts"]} >= {"/cache", "/tmp"}


def test_downloaded_sources_get_their_own_cache_directory():
    dirs = {arg(container(m.build_worker_deployment(OWNER, spec_with(**{"model.source": src}), "decode")),
                "--model") for src in (HF, URI, {"huggingFace": {"repo": "Qwen/Qwen2.5-0.5B", "revision": "v2"}})}
    assert len(dirs) == 3


def test_hugging_face_token_secret_endpoint_and_cache_claim():
    source = {"huggingFace": {"repo": "org/gated", "revision": "abc", "tokenSecret": "hf",
                              "endpoint": "http://hub-proxy.internal:8080"}}
    dep = m.build_worker_deployment(OWNER, spec_with(**{"model.source": source, "model.cacheClaimName": "cache"}),
                                    "prefill")
    pod = dep["spec"]["template"]["spec"]
    init = pod["initContainers"][0]
    env = {e["name"]: e for e in init["env"]}
    assert env["HF_TOKEN"]["valueFrom"] == {"secretKeyRef": {"name": "hf", "key": "HF_TOKEN"}}
    assert env["HF_ENDPOINT"]["value"] == "http://hub-proxy.internal:8080"
    assert init["args"][:5] == ["fetch-model", "--hf-repo", "org/gated", "--revision", "abc"]
    assert next(v for v in pod["volumes"] if v["name"] == "cache")["persistentVolumeClaim"] == {"claimName": "cache"}
    assert "HF_TOKEN" not in {e["name"] for e in container(dep)["env"]}, "the token stays in the init container"


def test_uri_credentials_secret_becomes_the_download_environment():
    dep = m.build_worker_deployment(OWNER, spec_with(**{"model.source": {"uri": {
        "url": "s3://bucket/llama/", "credentialsSecret": "s3"}}}), "decode")
    init = dep["spec"]["template"]["spec"]["initContainers"][0]
    assert init["envFrom"] == [{"secretRef": {"name": "s3"}}]
    assert init["args"][:3] == ["fetch-model", "--uri", "s3://bucket/llama/"]


def test_shared_storage_connector_mounts_the_claim_where_workers_look():
    dep = m.build_worker_deployment(OWNER, spec_with(**{"kvTransfer.connector": "SharedStorageConnector",
                                                         "kvTransfer.sharedStorage": {"claimName": "kv"}}),
                                    "decode")
    pod, c = dep["spec"]["template"]["spec"], container(dep)
    volume = next(v for v in pod["volumes"] if v["name"] == "kv-shared")
    assert volume["persistentVolumeClaim"] == {"claimName": "kv"}
    mount = next(vm for vm in c["volumeMounts"] if vm["name"] == "kv-shared")
    assert arg(c, "--kv-shared-storage-path") == mount["mountPath"]
    assert arg(c, "--kv-side-channel-port") is None


@pytest.mark.parametrize("changes, flag, value", [
    ({}, "--dtype", "bfloat16"),
    ({"model.dtype": "auto"}, "--dtype", "auto"),
    ({}, "--max-model-len", "8192"),
    ({"model.maxModelLen": None}, "--max-model-len", None),
    ({}, "--tensor-parallel-size", None),
    ({"kvTransfer.connector": "pkg.mod:Conn"}, "--kv-connector", "pkg.mod:Conn"),
    ({"kvTransfer.leaseSeconds": 7}, "--kv-lease-seconds", "7"),
    ({"kvTransfer.loadFailurePolicy": "fail"}, "--kv-load-failure-policy", "fail"),
    ({}, "--kv-side-channel-port", "5600"),
    ({}, "--served-model-name", "meta-llama/Meta-Llama-3-8B-Instruct"),
])
def test_worker_args(changes, flag, value):
    c = container(m.build_worker_deployment(OWNER, spec_with(**changes), "decode"))
    assert c["command"] == ["disagg"] and c["args"][:3] == ["worker", "--role", "decode"]
    assert arg(c, flag) == value


def test_extra_args_come_last():
    c = container(m.build_worker_deployment(OWNER, spec_with(), "decode"))
    assert c["args"][-2:] == ["--max-num-seqs", "256"]


@pytest.mark.parametrize("resources, requests, limits", [
    ({"gpus": 2}, {"nvidia.com/gpu": "2"}, {"nvidia.com/gpu": "2"}),
    ({"gpus": 0, "requests": {"cpu": 4}}, {"cpu": "4"}, None),
    ({"gpus": 1, "requests": {"memory": "8Gi"}, "limits": {"memory": "8Gi"}},
     {"memory": "8Gi", "nvidia.com/gpu": "1"}, {"memory": "8Gi", "nvidia.com/gpu": "1"}),
    ({}, None, None),
])
def test_gpu_and_resources(resources, requests, limits):
    c = container(m.build_worker_deployment(OWNER, spec_with(**{"prefill.resources": resources}), "prefill"))
    assert c["resources"].get("requests") == requests
    assert c["resources"].get("limits") == limits


@pytest.mark.parametrize("drain, pre_stop", [(5, ["sleep", "5"]), (0, None)])
def test_drain_and_grace(drain, pre_stop):
    dep = m.build_worker_deployment(OWNER, spec_with(**{"prefill.drainDelaySeconds": drain,
                                                        "prefill.terminationGracePeriodSeconds": 90}), "prefill")
    c = container(dep)
    assert (c.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command")) == pre_stop
    assert dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 90
    # preStop wait + request drain + KV lease (30) fit the grace period
    assert drain + int(arg(c, "--drain-timeout")) + 30 == 90


def test_worker_pod_contract():
    dep = m.build_worker_deployment(OWNER, spec_with(), "prefill")
    pod = dep["spec"]["template"]["spec"]
    c = container(dep)
    assert {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}} in c["env"]
    assert arg(c, "--kv-side-channel-host") == "$(POD_IP)"
    assert c["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert {p["containerPort"] for p in c["ports"]} == {8000, 5600}
    assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]
    assert pod["volumes"][0] == {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "8Gi"}}
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    # the selector never includes the revision: it is immutable on a Deployment
    assert naming.LABEL_REVISION not in dep["spec"]["selector"]["matchLabels"]
    assert dep["spec"]["template"]["metadata"]["labels"][naming.LABEL_REVISION] == m.serving_revision(spec_with())
    assert dep["metadata"]["ownerReferences"] == [OWNER.reference()]


# ---------------------------------------------------------------- security
RESTRICTED_POD = {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}


def restricted_container(*add: str) -> dict[str, Any]:
    caps: dict[str, Any] = {"drop": ["ALL"], **({"add": list(add)} if add else {})}
    return {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "capabilities": caps}


@pytest.mark.parametrize("rdma, component, add, device", [
    (None, "prefill", (), None),  # default: no capability, no RDMA device
    (None, "decode", (), None),
    (None, "router", (), None),
    ({"enabled": True}, "prefill", ("IPC_LOCK",), None),
    ({"enabled": True, "resourceName": "rdma/ib"}, "prefill", ("IPC_LOCK",), "rdma/ib"),
    ({"enabled": True, "resourceName": "rdma/hca_shared_devices_a"}, "decode", ("IPC_LOCK",),
     "rdma/hca_shared_devices_a"),
    ({"enabled": True, "resourceName": "rdma/ib"}, "router", (), None),  # the router only moves HTTP
    ({"enabled": False, "resourceName": "rdma/ib"}, "decode", (), None),  # switched off: the name is kept, unused
])
def test_security_context_and_rdma(rdma, component, add, device):
    spec = spec_with(**({"kvTransfer.rdma": rdma} if rdma else {}))
    dep = m.build_router_deployment(OWNER, spec) if component == "router" else \
        m.build_worker_deployment(OWNER, spec, component)
    pod, c = dep["spec"]["template"]["spec"], container(dep)
    assert pod["securityContext"] == RESTRICTED_POD
    assert c["securityContext"] == restricted_container(*add)
    assert not {"hostNetwork", "hostIPC", "hostPID"} & pod.keys()
    res = c.get("resources", {})
    devices = {k for k in (*res.get("requests", {}), *res.get("limits", {})) if "/" in k and "gpu" not in k}
    assert devices == ({device} if device else set())
    if device:  # an extended resource: request = limit
        assert res["requests"][device] == res["limits"][device] == "1"
    if component != "router":
        assert res["limits"]["nvidia.com/gpu"] == "1", "the GPUs stay"


@pytest.mark.parametrize("component", ["prefill", "decode", "router"])
def test_read_only_root_filesystem_leaves_the_paths_the_process_writes(component):
    """The worker writes /dev/shm (NCCL/UCX/torch shared memory) and /tmp, the model download the cache
    (HF_HOME) and /tmp; the router only /tmp. Each must be a mounted volume."""
    spec = spec_with(**{"model.source": HF})
    dep = m.build_router_deployment(OWNER, spec) if component == "router" else \
        m.build_worker_deployment(OWNER, spec, component)
    pod, c = dep["spec"]["template"]["spec"], container(dep)
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    mounts = {vm["mountPath"]: vm["name"] for vm in c["volumeMounts"]}
    writable = ["/tmp"] if component == "router" else ["/tmp", "/dev/shm"]
    if component != "router":
        init = pod["initContainers"][0]
        assert init["securityContext"]["readOnlyRootFilesystem"] is True
        init_mounts = {vm["mountPath"] for vm in init["volumeMounts"]}
        assert {"/tmp", next(e["value"] for e in init["env"] if e["name"] == "HF_HOME")} <= \
            {p for p in ("/tmp", "/cache/huggingface") if any(p == mp or p.startswith(mp + "/") for mp in init_mounts)}
    for path in writable:
        mount = next((mp for mp in mounts if path == mp or path.startswith(mp + "/")), None)
        assert mount is not None, f"{path} is not on a mounted volume"
        volume = next(v for v in pod["volumes"] if v["name"] == mounts[mount])
        assert "emptyDir" in volume, volume


@pytest.mark.parametrize("changes, revision_changes, prefill_rolls, decode_rolls", [
    ({"image": "img:2"}, True, True, True),
    ({"model.maxModelLen": 4096}, True, True, True),
    ({"kvTransfer.leaseSeconds": 60}, True, True, True),
    ({"kvTransfer.rdma": {"enabled": True}}, True, True, True),  # both pools must use the same transport
    ({"prefill.env": [{"name": "X", "value": "1"}]}, False, True, False),
    ({"decode.replicas": 9}, False, False, False),  # scaling never rolls pods
    ({"router.policy": "round-robin"}, False, False, False),
])
def test_what_rolls_which_pool(changes, revision_changes, prefill_rolls, decode_rolls):
    before, after = spec_with(), spec_with(**changes)
    assert (m.serving_revision(before) != m.serving_revision(after)) == revision_changes

    def config_hash(spec, role):
        return m.build_worker_deployment(OWNER, spec, role)["spec"]["template"]["metadata"]["annotations"][
            naming.ANNOTATION_CONFIG_HASH]
    assert (config_hash(before, "prefill") != config_hash(after, "prefill")) == prefill_rolls
    assert (config_hash(before, "decode") != config_hash(after, "decode")) == decode_rolls


def test_router_and_services():
    spec = spec_with(**{"router.service": {"type": "LoadBalancer", "port": 80}})
    router = m.build_router_deployment(OWNER, spec)
    args = container(router)["args"]
    assert args[:1] == ["router"] and arg(container(router), "--namespace") == "serving"
    assert arg(container(router), "--prefill-selector") == \
        "app.kubernetes.io/name=disagg,app.kubernetes.io/instance=llama,app.kubernetes.io/component=prefill"
    assert arg(container(router), "--policy") == "least-loaded"
    assert container(router)["readinessProbe"]["httpGet"]["path"] == "/ready"
    # liveness waits for a start-up of its own (a node busy starting workers must not restart the router in a loop)
    startup = container(router)["startupProbe"]
    assert startup["httpGet"]["path"] == "/health"
    assert startup["periodSeconds"] * startup["failureThreshold"] > 3 * container(router)["livenessProbe"]["periodSeconds"]
    svc = m.build_router_service(OWNER, spec)
    assert svc["metadata"]["name"] == "llama" and svc["spec"]["type"] == "LoadBalancer"
    assert svc["spec"]["ports"][0]["port"] == 80
    assert m.router_endpoint(OWNER, spec) == "http://llama.serving.svc:80"
    headless = m.build_headless_service(OWNER, "prefill")
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["selector"][naming.LABEL_COMPONENT] == "prefill"


def test_children_are_named_labelled_and_owned():
    children = m.desired_children(OWNER, spec_with())
    names = [(c["kind"], c["metadata"]["name"]) for c in children]
    assert names == [("NetworkPolicy", "llama-prefill"), ("NetworkPolicy", "llama-decode"),
                     ("NetworkPolicy", "llama-router"),
                     ("ServiceAccount", "llama-router"), ("Role", "llama-router"), ("RoleBinding", "llama-router"),
                     ("Service", "llama-prefill"), ("Service", "llama-decode"), ("Service", "llama"),
                     ("Deployment", "llama-prefill"), ("Deployment", "llama-decode"), ("Deployment", "llama-router")]
    for c in children:
        assert c["metadata"]["ownerReferences"][0]["uid"] == OWNER.uid
        assert c["metadata"]["labels"][naming.LABEL_MANAGED_BY] == naming.MANAGED_BY
        assert c["metadata"]["namespace"] == "serving"


def test_builders_are_deterministic():
    assert m.desired_children(OWNER, spec_with()) == m.desired_children(OWNER, spec_with())


@pytest.mark.parametrize("changes", [{}, {"kvTransfer.rdma": {"enabled": True, "resourceName": "rdma/ib"}}])
def test_children_validate_against_kubernetes_schemas(changes, tmp_path: Path):
    pytest.importorskip("kubernetes_validate")
    f = tmp_path / "children.yaml"
    f.write_text(yaml.safe_dump_all(m.desired_children(OWNER, spec_with(**changes))))
    out = subprocess.run([sys.executable, "-m", "kubernetes_validate", "--strict", "-k", "1.30.0", "--quiet",
                          str(f)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
