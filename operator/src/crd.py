"""Generate the CustomResourceDefinition from the pydantic models in spec.py.

`disagg crd --out crds --out charts/disagg-operator/crds` (or `python -m disagg.operator.crd ...`) writes
<plural>.<group>.yaml into each directory named - the repository's crds/ and the Helm chart's copy; without --out
those two, relative to the current directory (a checkout's root). `--check` fails on drift of any.
Pydantic's JSON schema is rewritten into a Kubernetes structural schema: $refs inlined, Optional collapsed,
int|str quantities as x-kubernetes-int-or-string, free-form objects as x-kubernetes-preserve-unknown-fields.
"""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Any

import yaml

from disagg.operator import spec as s
from disagg.operator.naming import APP_NAME, LABEL_NAME, MAX_NAME_LENGTH

log = logging.getLogger(__name__)

CRD_NAME = f"{s.PLURAL}.{s.GROUP}"
# without --out, relative to the current directory: the repository's copy and the Helm chart's (it installs CRDs
# from its crds/)
DEFAULT_OUT = (Path("crds"), Path("charts") / "disagg-operator" / "crds")
FILE_NAME = f"{CRD_NAME}.yaml"
# the scale target an HPA or KEDA drives (spec.autoscaling.mode external): the decode pool; prefill follows it
# within the ratio bounds (plan.initial_replicas), so one /scale serves both pools
SCALE = {"specReplicasPath": ".spec.decode.replicas", "statusReplicasPath": ".status.decode.replicas",
         "labelSelectorPath": ".status.decode.selector"}

# keys a structural schema may carry (apiextensions.k8s.io/v1 JSONSchemaProps, minus what we never emit)
_KEPT = {"type", "description", "default", "enum", "minimum", "maximum", "minLength", "maxLength", "pattern",
         "minItems", "maxItems", "maxProperties", "format", "required"}


def _structural(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    if "$ref" in node:
        target = defs[node["$ref"].rsplit("/", 1)[-1]]
        merged = {**target, **{k: v for k, v in node.items() if k != "$ref"}}
        return _structural(merged, defs)
    if "anyOf" in node:
        branches = [b for b in node["anyOf"] if b.get("type") != "null"]
        outer = {k: v for k, v in node.items() if k != "anyOf"}
        if len(branches) == 1:
            return _structural({**branches[0], **outer}, defs)
        types = sorted(b.get("type", "") for b in branches)
        if types == ["integer", "string"]:
            # the form controller-gen emits for resource.Quantity: bare types in anyOf, pattern outside
            out = _structural(outer, defs)
            out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
            out.update({k: b[k] for b in branches for k in ("pattern",) if k in b})
            out["x-kubernetes-int-or-string"] = True
            return out
        raise ValueError(f"cannot express anyOf {node['anyOf']!r} in a structural schema")
    out: dict[str, Any] = {k: v for k, v in node.items() if k in _KEPT}
    if "description" in out:
        out["description"] = " ".join(out["description"].split())  # docstrings wrap; the schema need not
    if out.get("default", 0) is None:
        del out["default"]
    if node.get("x-kubernetes-preserve-unknown-fields"):
        return {"type": "object", "x-kubernetes-preserve-unknown-fields": True,
                **({"description": node["description"]} if "description" in node else {})}
    if "properties" in node:
        out["properties"] = {name: _structural(sub, defs) for name, sub in node["properties"].items()}
    elif isinstance(node.get("additionalProperties"), dict):
        out["additionalProperties"] = _structural(node["additionalProperties"], defs)
    if "items" in node:
        out["items"] = _structural(node["items"], defs)
    return out


def model_schema(model: type) -> dict[str, Any]:
    raw = model.model_json_schema(by_alias=True, mode="validation")  # type: ignore[attr-defined]
    return _structural(raw, raw.get("$defs", {}))


def _printer_columns() -> list[dict[str, Any]]:
    return [
        {"name": "Ready", "type": "string", "jsonPath": '.status.conditions[?(@.type=="Ready")].status'},
        {"name": "Prefill", "type": "integer", "jsonPath": ".status.prefill.readyReplicas"},
        {"name": "Decode", "type": "integer", "jsonPath": ".status.decode.readyReplicas"},
        {"name": "Router", "type": "integer", "jsonPath": ".status.router.readyReplicas"},
        {"name": "Endpoint", "type": "string", "jsonPath": ".status.endpoint", "priority": 1},
        {"name": "Revision", "type": "string", "jsonPath": ".status.revision", "priority": 1},
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    ]


def build_crd() -> dict[str, Any]:
    root = {
        "type": "object",
        "description": "A prefill/decode disaggregated LLM deployment: prefill pool, decode pool and router.",
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": model_schema(s.DisaggregatedInferenceSpec),
            "status": model_schema(s.DisaggregatedInferenceStatus),
        },
        "x-kubernetes-validations": [{
            "rule": f"self.metadata.name.size() <= {MAX_NAME_LENGTH}",
            "message": f"metadata.name must be at most {MAX_NAME_LENGTH} characters (children add suffixes)",
        }],
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": CRD_NAME, "labels": {LABEL_NAME: APP_NAME}},
        "spec": {
            "group": s.GROUP,
            "scope": "Namespaced",
            "names": {"kind": s.KIND, "listKind": f"{s.KIND}List", "plural": s.PLURAL,
                      "singular": s.SINGULAR, "shortNames": list(s.SHORT_NAMES), "categories": ["all"]},
            "versions": [{
                "name": s.VERSION,
                "served": True,
                "storage": True,
                "subresources": {"status": {}, "scale": SCALE},
                "additionalPrinterColumns": _printer_columns(),
                "schema": {"openAPIV3Schema": root},
            }],
        },
    }


def render_crd() -> str:
    header = "# Generated by `disagg crd` from disagg/operator/spec.py. Do not edit by hand.\n"
    return header + yaml.safe_dump(build_crd(), sort_keys=False, width=120)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-o", "--out", action="append", type=Path, metavar="DIR",
                        help="a directory for the CRD YAML, repeated for each copy (default: "
                             f"{' and '.join(map(str, DEFAULT_OUT))} in the current directory, a checkout's root)")
    parser.add_argument("--check", action="store_true", help="exit 1 if a file differs from the models")
    parser.add_argument("--stdout", action="store_true", help="write the YAML to stdout instead")


def run(args: argparse.Namespace) -> int:
    text = render_crd()
    if args.stdout:
        sys.stdout.write(text)
        return 0
    if not args.out and not DEFAULT_OUT[0].is_dir():
        sys.stderr.write(f"no {DEFAULT_OUT[0]}/ in {Path.cwd()}: run from the checkout's root or give --out DIR\n")
        return 2
    paths = [d / FILE_NAME for d in args.out or DEFAULT_OUT]
    if args.check:
        stale = [p for p in paths if (p.read_text() if p.exists() else "") != text]
        for path in stale:
            sys.stderr.write(f"{path} is out of date: run `disagg crd`\n")
        return 1 if stale else 0
    for path in paths:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        log.info("wrote %s", path)
    return 0


if __name__ == "__main__":
    p = argparse.ArgumentParser(prog="python -m disagg.operator.crd", description=__doc__)
    add_arguments(p)
    sys.exit(run(p.parse_args()))
