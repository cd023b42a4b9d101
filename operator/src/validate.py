"""`disagg validate -f FILE`: check DisaggregatedInference documents offline with the models the operator uses.

Prints every problem as `<doc name>: <field path>: <message>`; exit 1 when there is any.
"""
from __future__ import annotations

import argparse
import sys
from typing import Any

import yaml

from disagg.operator import spec as s
from disagg.operator.checks import Problem, Target, check_spec, name_problems


def validate_document(doc: Any, target: Target = "kubernetes") -> list[Problem]:
    """Schema (pydantic) problems first; the checks beyond the schema only run on a spec that parsed."""
    if not isinstance(doc, dict):
        return [Problem("(document)", f"expected a mapping, got {type(doc).__name__}")]
    problems: list[Problem] = []
    if doc.get("apiVersion") != s.API_VERSION:
        problems.append(Problem("apiVersion", f"expected {s.API_VERSION!r}, got {doc.get('apiVersion')!r}"))
    if doc.get("kind") != s.KIND:
        problems.append(Problem("kind", f"expected {s.KIND!r}, got {doc.get('kind')!r}"))
    name = (doc.get("metadata") or {}).get("name")
    if not isinstance(name, str):
        problems.append(Problem("metadata.name", "required"))
    else:
        problems += name_problems(name)
    raw_spec = doc.get("spec")
    if not isinstance(raw_spec, dict):
        return problems + [Problem("spec", "required: a mapping")]
    return problems + check_spec(raw_spec, target)[1]


def load_documents(text: str) -> list[Any]:
    return [d for d in yaml.safe_load_all(text) if d is not None]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-f", "--filename", required=True, help="YAML file with one or more documents ('-' = stdin)")
    parser.add_argument("--target", choices=["kubernetes", "local"], default="kubernetes",
                        help="kubernetes also requires an image and a model source; local (`disagg up`) does not")


def run(args: argparse.Namespace) -> int:
    try:
        text = sys.stdin.read() if args.filename == "-" else open(args.filename, encoding="utf-8").read()
        docs = load_documents(text)
    except (OSError, yaml.YAMLError) as e:
        sys.stderr.write(f"{args.filename}: {e}\n")
        return 1
    if not docs:
        sys.stderr.write(f"{args.filename}: no documents\n")
        return 1
    failed = False
    for i, doc in enumerate(docs):
        label = ((doc.get("metadata") or {}).get("name") if isinstance(doc, dict) else None) or f"document {i}"
        for problem in validate_document(doc, args.target):
            failed = True
            sys.stdout.write(f"{args.filename}: {label}: {problem}\n")
    if not failed:
        sys.stdout.write(f"{args.filename}: {len(docs)} document(s) valid for {args.target}\n")
    return 1 if failed else 0
