"""The spec models, the generated CRD (drift, schema checks) and `disagg validate`."""
from __future__ import annotations

import argparse
import copy
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from openapi_schema_validator import OAS30Validator

from disagg.operator import crd, validate
from disagg.operator import spec as s
from disagg.operator.checks import semantic_problems

ROOT = Path(__file__).resolve().parents[3]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
GPU_EXAMPLE = yaml.safe_load((ROOT / "examples" / "llama3-8b-gpu.yaml").read_text())


def with_spec(**changes: Any) -> dict[str, Any]:
    """The GPU example with dotted-path changes, e.g. {"autoscaling.decode.minReplicas": 9}."""
    doc = copy.deepcopy(GPU_EXAMPLE)
    for dotted, value in changes.items():
        node = doc["spec"]
        *parents, last = dotted.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
    return doc


def schema_validator() -> OAS30Validator:
    return OAS30Validator(crd.build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"])


def test_crd_file_matches_the_models():
    path = ROOT / "crds" / crd.FILE_NAME
    assert path.read_text() == crd.render_crd(), "crds/ is stale: run `disagg crd`"


def test_crd_names_and_version():
    c = crd.build_crd()
    assert c["metadata"]["name"] == "disaggregatedinferences.disagg.dev"
    v = c["spec"]["versions"][0]
    assert (v["name"], v["served"], v["storage"]) == ("v1alpha1", True, True)
    # /scale: the decode pool as an HPA's or KEDA's scale target (spec.autoscaling.mode external)
    assert v["subresources"] == {"status": {}, "scale": {
        "specReplicasPath": ".spec.decode.replicas", "statusReplicasPath": ".status.decode.replicas",
        "labelSelectorPath": ".status.decode.selector"}}
    assert c["spec"]["names"]["shortNames"] == ["dinf"]
    assert {col["name"] for col in v["additionalPrinterColumns"]} >= {"Ready", "Prefill", "Decode", "Age"}


def test_crd_schema_is_structural():
    """No $ref, title or anyOf-with-types left over from pydantic, except the int-or-string form."""
    def walk(node: Any, path: str) -> None:
        if isinstance(node, dict):
            assert "$ref" not in node and "title" not in node and "$defs" not in node, path
            if "anyOf" in node:
                assert node.get("x-kubernetes-int-or-string") is True, path
            elif node.get("x-kubernetes-preserve-unknown-fields") is not True and "properties" in node:
                assert node.get("type") == "object", path
            for k, v in node.items():
                walk(v, f"{path}.{k}")
        elif isinstance(node, list):
            for i, v in enumerate(node):
                walk(v, f"{path}[{i}]")
    walk(crd.build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"], "schema")


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_validate_against_the_crd_schema(path: Path):
    for doc in yaml.safe_load_all(path.read_text()):
        errors = list(schema_validator().iter_errors(doc))
        assert not errors, [e.message for e in errors]


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_pass_disagg_validate(path: Path, capsys: pytest.CaptureFixture[str]):
    target = "local" if path.name == "local.yaml" else "kubernetes"
    assert validate.run(argparse.Namespace(filename=str(path), target=target)) == 0


@pytest.mark.parametrize("changes", [
    {"kvTransfer.loadFailurePolicy": "retry"},  # enum
    {"kvTransfer.leaseSeconds": 0},  # minimum
    {"prefill.replicas": 1.5},  # integers only
    {"router.service.type": "Ingress"},
    {"model.source": {"huggingFace": {"repo": "a/b"}, "uri": {"url": "s3://x"}}},  # at most one source
    {"decode.resources": {"requests": {"memory": "lots"}}},  # quantity pattern
    {"autoscaling.targets": {"decode": {"kvCacheUsagePercent": 101}}},
    {"kvTransfer.rdma": {"enabled": True, "resourceName": "ib"}},  # a device-plugin resource has a prefix
    {"autoscaling.enabled": "yes"},  # no string-to-bool coercion: the models are as strict as the schema
    {"prefill.replicas": "2"},
])
def test_schema_and_models_both_reject(changes: dict[str, Any]):
    doc = with_spec(**changes)
    assert list(schema_validator().iter_errors(doc)), "CRD schema accepted it"
    assert validate.validate_document(doc), "models accepted it"


@pytest.mark.parametrize("changes, path", [
    ({"autoscaling.decode": {"minReplicas": 6, "maxReplicas": 2}}, "spec.autoscaling.decode.minReplicas"),
    ({"autoscaling.prefillDecodeRatio": {"min": {"prefill": 2, "decode": 1}, "max": {"prefill": 1, "decode": 1}}},
     "spec.autoscaling.prefillDecodeRatio"),
    ({"kvTransfer.connector": "FancyConnector"}, "spec.kvTransfer.connector"),
    ({"autoscaling.metricsSource": {"type": "prometheus"}}, "spec.autoscaling.metricsSource.prometheusUrl"),
    ({"prefill.drainDelaySeconds": 200}, "spec.prefill.drainDelaySeconds"),
    # grace 120 < preStop 5 + lease 110 + 10 s for running requests
    ({"kvTransfer.leaseSeconds": 110}, "spec.prefill.terminationGracePeriodSeconds"),
    ({"model.source": {}}, "spec.model.source"),
    ({"image": None}, "spec.image"),
    ({"kvTransfer.rdma": {"enabled": True, "resourceName": "rdma/ib"},
      "prefill.resources": {"gpus": 1, "limits": {"rdma/ib": 2}}}, "spec.prefill.resources"),
    # accepted by the CRD, once unusable on Kubernetes; now rejected by name
    ({"prefill.tensorParallelSize": 2}, "spec.prefill.tensorParallelSize"),
    ({"decode.tensorParallelSize": 4}, "spec.decode.tensorParallelSize"),
    ({"kvTransfer.connector": "SharedStorageConnector"}, "spec.kvTransfer.sharedStorage"),
    ({"model.source": {"uri": {"url": "gs://bucket/llama"}}}, "spec.model.source.uri.url"),
    ({"model.source": {"uri": {"url": "/models/llama"}}}, "spec.model.source.uri.url"),
    ({"model.source": {"uri": {"url": "s3:///llama"}}}, "spec.model.source.uri.url"),
    ({"decode.extraArgs": ["--no-such-flag"]}, "spec.decode.extraArgs"),
    ({"decode.extraArgs": ["--max-num-seqs", "many"]}, "spec.decode.extraArgs"),
    ({"prefill.extraArgs": ["--port", "9000"]}, "spec.prefill.extraArgs"),
    ({"prefill.extraArgs": ["--kv-side-channel-port=7000"]}, "spec.prefill.extraArgs"),
])
def test_schema_accepts_but_operator_rejects(changes: dict[str, Any], path: str):
    doc = with_spec(**changes)
    if doc["spec"].get("image") is None:
        doc["spec"].pop("image")
    assert not list(schema_validator().iter_errors(doc))
    assert [p.path for p in validate.validate_document(doc)] == [path]


@pytest.mark.parametrize("connector, ok", [
    ("NixlConnector", True), ("SharedStorageConnector", True), ("my_pkg.kv:MyConnector", True),
    ("nixl", False), ("my_pkg.kv", False), ("my_pkg.kv:", False),
])
def test_connector_names(connector: str, ok: bool):
    spec = s.parse_spec(with_spec(**{"kvTransfer.connector": connector,
                                     "kvTransfer.sharedStorage": {"claimName": "kv"}})["spec"])
    assert (not semantic_problems(spec, "kubernetes")) == ok


def test_model_source_kind_and_local_target():
    local = yaml.safe_load((ROOT / "examples" / "local.yaml").read_text())
    spec = s.parse_spec(local["spec"])
    assert spec.model.source.kind == "generated"
    assert semantic_problems(spec, "local") == []
    assert {p.path for p in semantic_problems(spec, "kubernetes")} == {"spec.image", "spec.model.source"}


def test_validate_prints_every_problem_with_its_path(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    bad = with_spec(**{"autoscaling.decode": {"minReplicas": 6, "maxReplicas": 2},
                       "kvTransfer.connector": "nope", "unknownField": 1})
    bad["metadata"]["name"] = "Bad_Name"
    f = tmp_path / "bad.yaml"
    f.write_text(yaml.safe_dump(bad))
    assert validate.run(argparse.Namespace(filename=str(f), target="kubernetes")) == 1
    out = capsys.readouterr().out
    assert "metadata.name" in out and "spec.unknownField" in out
    # semantic checks run once the schema passes
    bad["spec"].pop("unknownField")
    bad["metadata"]["name"] = "ok"
    f.write_text(yaml.safe_dump(bad))
    assert validate.run(argparse.Namespace(filename=str(f), target="kubernetes")) == 1
    out = capsys.readouterr().out
    assert "spec.autoscaling.decode.minReplicas" in out and "spec.kvTransfer.connector" in out


def test_crd_command_writes_and_checks(tmp_path: Path):
    args = argparse.Namespace(out=[tmp_path], check=True, stdout=False)
    assert crd.run(args) == 1  # nothing there yet: drift
    assert crd.run(argparse.Namespace(out=[tmp_path], check=False, stdout=False)) == 0
    assert crd.run(args) == 0
    assert yaml.safe_load((tmp_path / crd.FILE_NAME).read_text())["kind"] == "CustomResourceDefinition"


def test_autoscaling_fields_and_status_block():
    prometheus = {"type": "prometheus", "prometheusUrl": "http://p", "selector": 'namespace="ml"',
                  "podLabel": "kubernetes_pod_name"}
    a = s.parse_spec(with_spec(**{"autoscaling.latencyStatistic": "Mean", "autoscaling.staleAfterSeconds": 20,
                                  "autoscaling.targets": {"prefill": {"waitingPromptTokensPerPod": 4096}},
                                  "autoscaling.metricsSource": prometheus})["spec"]).autoscaling
    assert (a.latency_statistic, a.latency_percentile, a.stale_after_seconds) == ("Mean", 90, 20)
    assert a.targets.prefill.waiting_prompt_tokens_per_pod == 4096 and a.targets.transfer.pending_sends_per_pod == 2
    assert (a.metrics_source.selector, a.metrics_source.pod_label) == ('namespace="ml"', "kubernetes_pod_name")
    status = {"conditions": [{"type": t, "status": "True", "reason": "X"} for t in s.AUTOSCALING_CONDITIONS],
              "autoscaling": {"dryRun": False, "prefill": {"current": 1, "desired": 2, "reason": "PrefillBound"},
                              "decode": {"current": 2, "desired": 2, "reason": "WithinTolerance"},
                              "lastDecision": {"time": "2026-01-01T00:00:00Z", "role": "prefill", "from": 1, "to": 2,
                                               "reason": "PrefillBound", "bottleneck": "PrefillBound",
                                               "metrics": {"prefillWaitingRequestsPerPod": "9"}}}}
    assert s.DisaggregatedInferenceStatus.model_validate(status).model_dump(by_alias=True, exclude_none=True) \
        ["autoscaling"]["lastDecision"]["from"] == 1
    doc = with_spec()
    doc["status"] = status
    assert not list(schema_validator().iter_errors(doc))
    doc["spec"]["autoscaling"]["latencyPercentile"] = 99.5  # integers only
    assert list(schema_validator().iter_errors(doc))


def test_crd_check_covers_both_copies_and_names_a_missing_checkout(tmp_path: Path):
    """The documented command checks the repository's copy and the chart's; run elsewhere without --out it says
    what is missing instead of writing a crds/ tree there."""
    command = [sys.executable, "-m", "disagg.operator.crd", "--check"]
    both = ["--out", "crds", "--out", "charts/disagg-operator/crds"]
    for argv in (command, [*command, *both]):
        proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
    stale = tmp_path / "charts" / "disagg-operator" / "crds"
    stale.mkdir(parents=True)
    (stale / crd.FILE_NAME).write_text("old\n")
    (tmp_path / "crds").mkdir()
    (tmp_path / "crds" / crd.FILE_NAME).write_text(crd.render_crd())
    proc = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "disagg-operator/crds" in proc.stderr and "is out of date" in proc.stderr
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    proc = subprocess.run(command[:-1], cwd=elsewhere, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--out" in proc.stderr and not list(elsewhere.iterdir()), proc.stderr
