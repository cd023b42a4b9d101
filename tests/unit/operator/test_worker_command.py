"""Contract: nothing the CRD accepts may produce a pod command that the program in the pod rejects.

Every spec variant below is either rejected by `disagg validate` (and so by the operator) with a problem naming
the field, or every container of every pod the operator builds - init containers and the router included -
parses with the `disagg` CLI's own parser after Kubernetes' $(VAR) expansion. The same builder serves
`disagg up`: its commands parse too, and agree with the pods' on everything but placement.
"""
from __future__ import annotations

import argparse
import copy
import json
import itertools
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from disagg.operator import manifests as m
from disagg.operator import spec as s
from disagg.operator import validate
from disagg.operator import naming
from disagg.operator.plan import pod_model_dir
from disagg.worker.cli import build_parser

ROOT = Path(__file__).resolve().parents[3]
BASE = yaml.safe_load((ROOT / "examples" / "llama3-8b-gpu.yaml").read_text())
OWNER = m.Owner(name="llama", namespace="serving", uid="0000-1111")

CONNECTORS = {
    "nixl": {"connector": "NixlConnector"},
    "shared-storage": {"connector": "SharedStorageConnector", "sharedStorage": {"claimName": "kv"}},
    "shared-storage-no-claim": {"connector": "SharedStorageConnector"},
    "module-path": {"connector": "tests.kv:MyConnector"},
}
SOURCES = {
    "pvc": {"pvc": {"claimName": "models", "path": "llama"}},
    "pvc-root": {"pvc": {"claimName": "models"}},
    "path": {"path": "/opt/model"},
    "hf": {"huggingFace": {"repo": "Qwen/Qwen2.5-0.5B"}},
    "hf-full": {"huggingFace": {"repo": "org/gated", "revision": "v1", "tokenSecret": "hf",
                                "endpoint": "http://mirror.internal"}},
    "http": {"uri": {"url": "https://models.internal/llama.tar.gz"}},
    "s3": {"uri": {"url": "s3://bucket/llama/", "credentialsSecret": "s3"}},
    "gs": {"uri": {"url": "gs://bucket/llama"}},
}
EXTRA_ARGS = {"none": [], "valid": ["--max-num-seqs", "8", "--no-prefix-caching"], "unknown": ["--no-such-flag"],
              "owned": ["--port", "9000"]}
PARALLEL = (1, 2)
AUTOSCALING = (False, True)


class _Rejected(Exception):
    pass


class _RaisingParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise _Rejected(message)


def parse_like_the_pod(argv: list[str], env: dict[str, str]) -> argparse.Namespace:
    """Expand $(VAR) as the kubelet does, then parse as `disagg` would (argv[0] is the image's `disagg`)."""
    assert argv[0] == "disagg", argv
    expanded = [re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda mo: env.get(mo.group(1), mo.group(0)), a)
                for a in argv[1:]]
    assert not any("$(" in a for a in expanded), f"unexpanded variable in {expanded}"
    return build_parser(expanded, _RaisingParser).parse_args(expanded)


def document(connector: str, source: str, extra: str, tp: int, autoscaling: bool) -> dict[str, Any]:
    doc = copy.deepcopy(BASE)
    spec = doc["spec"]
    spec["kvTransfer"] = {**spec["kvTransfer"], **CONNECTORS[connector]}
    spec["model"]["source"] = SOURCES[source]
    spec["decode"]["extraArgs"] = EXTRA_ARGS[extra]
    spec["prefill"]["tensorParallelSize"] = tp
    spec["autoscaling"]["enabled"] = autoscaling
    return doc


VARIANTS = list(itertools.product(CONNECTORS, SOURCES, EXTRA_ARGS, PARALLEL, AUTOSCALING))
EXPECTED_PROBLEMS = {  # variant part -> the field the rejection must name
    ("connector", "shared-storage-no-claim"): "spec.kvTransfer.sharedStorage",
    ("source", "gs"): "spec.model.source.uri.url",
    ("extra", "unknown"): "spec.decode.extraArgs",
    ("extra", "owned"): "spec.decode.extraArgs",
    ("tp", 2): "spec.prefill.tensorParallelSize",
}


def pod_containers(doc: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    spec = s.parse_spec(doc["spec"])
    out = []
    for child in m.desired_children(OWNER, spec):
        if child["kind"] == "Deployment":
            pod = child["spec"]["template"]["spec"]
            out += [(child["metadata"]["name"], c) for c in [*pod.get("initContainers", []), *pod["containers"]]]
    return out


@pytest.mark.parametrize("connector, source, extra, tp, autoscaling", VARIANTS,
                         ids=["-".join(map(str, v)) for v in VARIANTS])
def test_every_accepted_variant_starts_or_is_rejected_by_name(connector, source, extra, tp, autoscaling):
    doc = document(connector, source, extra, tp, autoscaling)
    parts = {"connector": connector, "source": source, "extra": extra, "tp": tp}
    expected = {path for (part, value), path in EXPECTED_PROBLEMS.items() if parts[part] == value}
    problems = validate.validate_document(doc)
    assert {p.path for p in problems} == expected, problems
    if expected:
        return
    env = {"POD_IP": "10.1.2.3", "POD_NAME": "p", "POD_NAMESPACE": "serving"}
    for name, c in pod_containers(doc):
        args = parse_like_the_pod([*c["command"], *c["args"]], env)
        if args.command == "worker":
            assert args.kv_connector == doc["spec"]["kvTransfer"]["connector"], name
            mounts = {vm["mountPath"] for vm in c["volumeMounts"]}
            if source in ("pvc", "pvc-root", "hf", "hf-full", "http", "s3"):  # the model is on a mounted volume
                assert any(args.model == mp or args.model.startswith(mp + "/") for mp in mounts), (name, args.model)
            if connector == "shared-storage":
                assert args.shared_storage_path in mounts
            if connector == "nixl":
                assert args.side_channel_host == "10.1.2.3" and args.side_channel_port == naming.SIDE_CHANNEL_PORT
        elif args.command == "fetch-model":
            worker = next(w for n, w in pod_containers(doc) if n == name and w["name"] != "fetch-model")
            assert args.dest == worker["args"][worker["args"].index("--model") + 1]
        else:
            assert args.command == "router", name


def test_disagg_up_runs_the_same_command_with_local_placement(tmp_path):
    """`disagg up` and the operator share the builder: the same flags, only placement values differ."""
    from disagg.worker.local.launcher import worker_spec

    doc = document("nixl", "path", "valid", 1, False)
    spec = s.parse_spec(doc["spec"])
    ports = iter(range(20000, 20100))
    local = worker_spec(spec, "decode", 0, "/opt/model", "127.0.0.1", lambda: next(ports), str(tmp_path))
    pod = next(c for n, c in pod_containers(doc) if n == "llama-decode")
    placement_flags = {"--host", "--port", "--kv-side-channel-host", "--kv-side-channel-port", "--model"}

    def flags(argv: list[str]) -> dict[str, str]:
        out, i = {}, 0
        while i < len(argv):
            if argv[i].startswith("--"):
                has_value = i + 1 < len(argv) and not argv[i + 1].startswith("--")
                out[argv[i]] = argv[i + 1] if has_value else ""
                i += 2 if has_value else 1
            else:
                i += 1
        return {k: v for k, v in out.items() if k not in placement_flags}

    local_args = local.argv[local.argv.index("worker"):]
    assert flags(local_args) == flags(pod["args"])
    parse_like_the_pod(["disagg", *local_args], {})


# ---------------------------------------------------------------- engine vllm
# vLLM's parser cannot be imported here (the vLLM tier, tests/vllm, starts these commands for real); these tests
# pin the structure the pods rely on.
VLLM_BASE = yaml.safe_load((ROOT / "examples" / "llama3-8b-vllm.yaml").read_text())


def vllm_document(**spec_changes: Any) -> dict[str, Any]:
    doc = copy.deepcopy(VLLM_BASE)
    doc["spec"].update(spec_changes)
    return doc


def worker_container(doc: dict[str, Any], role: str) -> dict[str, Any]:
    return next(c for n, c in pod_containers(doc) if n == f"llama-{role}" and c["name"] == role)


def flag_value(argv: list[str], flag: str) -> str:
    assert argv.count(flag) == 1, (flag, argv)
    return argv[argv.index(flag) + 1]


def test_the_vllm_example_is_accepted():
    assert validate.validate_document(vllm_document()) == []


@pytest.mark.parametrize("role, kv_role", [("prefill", "kv_producer"), ("decode", "kv_consumer")])
def test_vllm_pods_run_vllm_serve_with_nixl_per_role(role, kv_role):
    import json

    doc = vllm_document()
    pod = worker_container(doc, role)
    argv = [*pod["command"], *pod["args"]]
    spec = s.parse_spec(doc["spec"])
    assert argv[:3] == ["vllm", "serve", pod_model_dir(spec)]  # the positional model, as the fetch-model dest
    assert pod["image"] == doc["spec"]["engineImage"]
    # vLLM listens on the pod's loopback; `disagg pd-proxy` owns the pod's HTTP port (test_pd_proxy_command.py)
    assert (flag_value(argv, "--host"), flag_value(argv, "--port")) == ("127.0.0.1", str(naming.ENGINE_PORT))
    assert flag_value(argv, "--served-model-name") == doc["spec"]["model"]["servedName"]
    tp = doc["spec"][role]["tensorParallelSize"]
    assert flag_value(argv, "--tensor-parallel-size") == str(tp)
    kv = doc["spec"]["kvTransfer"]
    assert json.loads(flag_value(argv, "--kv-transfer-config")) == {
        "kv_connector": "NixlConnector", "kv_role": kv_role, "kv_buffer_device": "cuda",
        "kv_load_failure_policy": "recompute", "kv_connector_extra_config": {"kv_lease_duration": kv["leaseSeconds"]}}
    # SIGTERM drains running requests (vLLM's default aborts them) within the grace period
    assert 1 <= int(flag_value(argv, "--shutdown-timeout")) < doc["spec"][role].get("terminationGracePeriodSeconds", 120)
    # engineArgs for both roles, then the role's extraArgs
    tail = [*doc["spec"]["engineArgs"], *doc["spec"][role].get("extraArgs", [])]
    assert argv[len(argv) - len(tail):] == tail
    env = {e["name"]: e for e in pod["env"]}
    assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"]["value"] == "$(POD_IP)"
    # the kubelet expands $(POD_IP) only from variables declared before it
    assert list(env).index("POD_IP") < list(env).index("VLLM_NIXL_SIDE_CHANNEL_HOST")
    assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"]["value"] == str(naming.SIDE_CHANNEL_PORT)
    assert {p["containerPort"] for p in pod["ports"]} == {naming.SIDE_CHANNEL_PORT}
    # the probes are the pd-proxy's (its /ready; /health passes through to vLLM)
    assert not {"startupProbe", "livenessProbe", "readinessProbe"} & set(pod)
    assert "DISAGG_HANDOFF_KEY" not in env, "vLLM never sees the hand-off key"
    gpus = pod["resources"]["limits"]["nvidia.com/gpu"]
    assert gpus == pod["resources"]["requests"]["nvidia.com/gpu"] == str(max(tp, 1))


def test_vllm_without_gpus_keeps_kv_in_host_memory():
    import json

    doc = vllm_document()
    for role in ("prefill", "decode"):
        doc["spec"][role]["tensorParallelSize"] = 1
        doc["spec"][role]["resources"] = {"requests": {"cpu": 2}}
    assert validate.validate_document(doc) == []
    for role in ("prefill", "decode"):
        c = worker_container(doc, role)
        config = json.loads(flag_value(c["args"], "--kv-transfer-config"))
        assert config["kv_buffer_device"] == "cpu"
        assert "nvidia.com/gpu" not in c["resources"].get("limits", {})


def test_vllm_downloads_with_the_disagg_image_into_the_directory_vllm_serves():
    doc = vllm_document()
    fetch = next(c for n, c in pod_containers(doc) if n == "llama-decode" and c["name"] == "fetch-model")
    worker = worker_container(doc, "decode")
    assert fetch["image"] == doc["spec"]["image"]
    assert parse_like_the_pod([*fetch["command"], *fetch["args"]], {}).dest == worker["args"][1]


@pytest.mark.parametrize("change, path", [
    ({"kvTransfer": {"connector": "SharedStorageConnector", "sharedStorage": {"claimName": "kv"}}},
     "spec.kvTransfer.connector"),
    ({"kvTransfer": {"connector": "tests.kv:MyConnector"}}, "spec.kvTransfer.connector"),
    ({"engineArgs": ["--port", "9000"]}, "spec.engineArgs"),
    ({"engineArgs": ["--kv-transfer-config={}"]}, "spec.engineArgs"),
    ({"decode": {"extraArgs": ["--tensor-parallel-size", "4"]}}, "spec.decode.extraArgs"),
    ({"prefill": {"tensorParallelSize": 4, "resources": {"gpus": 2}}}, "spec.prefill.resources.gpus"),
])
def test_vllm_variants_that_cannot_run_are_rejected_by_name(change, path):
    doc = vllm_document(**change)
    problems = validate.validate_document(doc)
    assert [p.path for p in problems] == [path], problems


def test_engines_cannot_mix_between_roles():
    """One spec.engine for both pools: a per-role engine is not even a field."""
    doc = vllm_document()
    doc["spec"]["decode"]["engine"] = "disagg"
    assert any(p.path.startswith("spec.decode") for p in validate.validate_document(doc))


def test_the_disagg_engine_still_rejects_tensor_parallelism_and_takes_engine_args():
    doc = document("nixl", "path", "none", 2, False)
    assert [p.path for p in validate.validate_document(doc)] == ["spec.prefill.tensorParallelSize"]
    doc = document("nixl", "path", "none", 1, False)
    doc["spec"]["engineArgs"] = ["--max-num-seqs", "8"]
    assert validate.validate_document(doc) == []
    pod = worker_container(doc, "prefill")
    assert parse_like_the_pod([*pod["command"], *pod["args"]], {"POD_IP": "10.1.2.3"}).max_num_seqs == 8


def test_disagg_up_runs_the_vllm_command_with_local_placement(tmp_path):
    from disagg.worker.local.launcher import worker_spec

    doc = vllm_document()
    spec = s.parse_spec(doc["spec"])
    ports = iter(range(20000, 20100))
    local = worker_spec(spec, "decode", 0, "/opt/model", "127.0.0.1", lambda: next(ports), str(tmp_path),
                        vllm_executable="/opt/vllm/bin/vllm")
    assert local.argv[:3] == ["/opt/vllm/bin/vllm", "serve", "/opt/model"]
    assert local.env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "127.0.0.1"
    assert local.url == f"http://127.0.0.1:{flag_value(local.argv, '--port')}"
    assert local.env["VLLM_NIXL_SIDE_CHANNEL_PORT"] != flag_value(local.argv, "--port")


def test_disagg_up_with_engine_vllm_says_clearly_when_vllm_is_missing(tmp_path, monkeypatch, capsys):
    from disagg.worker.local import launcher

    doc = vllm_document()
    doc["spec"]["model"]["source"] = {"path": str(tmp_path)}
    doc["spec"].pop("engineImage")
    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text(yaml.safe_dump(doc))
    monkeypatch.delenv(launcher.VLLM_ENV, raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # no vllm there
    parser = argparse.ArgumentParser()
    launcher.add_arguments(parser)
    assert launcher.run(parser.parse_args(["-f", str(spec_file)])) == 2
    err = capsys.readouterr().err
    assert "vLLM is not installed" in err and "--vllm" in err and launcher.VLLM_ENV in err, err
    assert launcher.run(parser.parse_args(["-f", str(spec_file), "--vllm", str(tmp_path / "nope")])) == 2
    assert "not an executable" in capsys.readouterr().err


# ---------------------------------------------------------------- router.policy prefix-aware
def test_prefix_aware_turns_on_the_workers_kv_events_and_exposes_their_ports(tmp_path):
    from disagg.worker.local.launcher import worker_spec

    doc = document("nixl", "path", "none", 1, False)
    doc["spec"]["router"] = {**doc["spec"].get("router", {}), "policy": "prefix-aware"}
    assert validate.validate_document(doc) == []
    env = {"POD_IP": "10.1.2.3", "POD_NAME": "p", "POD_NAMESPACE": "serving"}
    for role in ("prefill", "decode"):
        c = next(c for n, c in pod_containers(doc) if n == f"llama-{role}" and c["name"] == role)
        args = parse_like_the_pod([*c["command"], *c["args"]], env)
        # at the pod IP, never a wildcard: the events carry the prompts' token ids
        assert (args.kv_events_endpoint, args.kv_events_replay_endpoint) == ("tcp://10.1.2.3:5557",
                                                                             "tcp://10.1.2.3:5558")
        assert {p["name"]: p["containerPort"] for p in c["ports"]}.items() >= {"kv-events": 5557,
                                                                              "kv-events-replay": 5558}.items()
    router = next(c for n, c in pod_containers(doc) if n == "llama-router")
    assert flag_value(router["args"], "--policy") == "prefix-aware"
    # disagg up: the same flags on loopback, fresh ports per worker
    ports = iter(range(20000, 20100))
    spec = s.parse_spec(doc["spec"])
    local = [worker_spec(spec, "decode", i, "/m", "127.0.0.1", lambda: next(ports), str(tmp_path)) for i in range(2)]
    endpoints = [flag_value(w.argv, "--kv-events-endpoint") for w in local]
    assert all(e.startswith("tcp://127.0.0.1:") for e in endpoints) and len(set(endpoints)) == 2
    # off by default
    plain = document("nixl", "path", "none", 1, False)
    assert all("--kv-events-endpoint" not in c["args"] for _, c in pod_containers(plain))


def test_prefix_aware_with_vllm_workers_turns_on_vllms_kv_events_on_the_fixed_ports(tmp_path):
    from disagg.worker.local.launcher import worker_spec

    doc = vllm_document(router={"policy": "prefix-aware"})
    assert validate.validate_document(doc) == []
    for role in ("prefill", "decode"):
        c = worker_container(doc, role)
        argv = [*c["command"], *c["args"]]
        events = json.loads(flag_value(argv, "--kv-events-config"))
        # vLLM binds its PUB only at a wildcard (the chart README says so); the replay at the pod IP
        assert events == {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:5557",
                          "replay_endpoint": "tcp://$(POD_IP):5558", "topic": "kv-events"}
        assert "--enable-prefix-caching" in argv and "--no-enable-prefix-caching" not in argv
        assert {p["name"]: p["containerPort"] for p in c["ports"]}.items() >= {"kv-events": 5557,
                                                                              "kv-events-replay": 5558}.items()
    # vLLM has no GET /kv_events: the router is told the ports (and the topic) instead
    router = next(c for n, c in pod_containers(doc) if n == "llama-router")
    assert (flag_value(router["args"], "--kv-events-port"), flag_value(router["args"], "--kv-events-replay-port"),
            flag_value(router["args"], "--kv-events-topic")) == ("5557", "5558", "kv-events")
    # a user cannot turn prefix caching off under a prefix-aware router
    off = vllm_document(router={"policy": "prefix-aware"}, engineArgs=["--enable-prefix-caching"])
    assert "spec.engineArgs" in [p.path for p in validate.validate_document(off)]
    # disagg up: loopback, fresh ports per worker, announced for the router's endpoints file
    ports = iter(range(20000, 20100))
    spec = s.parse_spec(doc["spec"])
    local = [worker_spec(spec, "decode", i, "/m", "127.0.0.1", lambda: next(ports), str(tmp_path), (), "/bin/true")
             for i in range(2)]
    configs = [json.loads(flag_value(w.argv, "--kv-events-config")) for w in local]
    # vLLM binds its PUB only at a wildcard; the router connects to the worker's host at the same port
    assert [c["endpoint"].rsplit(":", 1)[1] for c in configs] == \
        [w.kv_events["endpoint"].rsplit(":", 1)[1] for w in local]
    assert all(c["endpoint"].startswith("tcp://*:") and w.kv_events["endpoint"].startswith("tcp://127.0.0.1:")
               and c["replay_endpoint"] == w.kv_events["replay_endpoint"] for c, w in zip(configs, local))
    assert len({c["endpoint"] for c in configs}) == 2
    assert all(w.kv_events["topic"] == "kv-events" for w in local)
    # off by default
    assert all("--kv-events-config" not in c["args"] for _, c in pod_containers(vllm_document()))
