"""Contract: nothing the CRD accepts may produce a pod command that the program in the pod rejects.

Every spec variant below is either rejected by `disagg validate` (and so by the operator) with a problem naming
the field, or every container of every pod the operator builds - init containers and the router included -
parses with the `disagg` CLI's own parser after Kubernetes' $(VAR) expansion. The same builder serves
`disagg up`: its commands parse too, and agree with the pods' on everything but placement.
"""
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
from disagg.operator import spec as s
from disagg.operator import validate
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
                assert args.side_channel_host == "10.1.2.3" and args.side_channel_port == m.SIDE_CHANNEL_PORT
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
