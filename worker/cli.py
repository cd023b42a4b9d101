"""`disagg` command line. Each subcommand imports its own module lazily, so the worker image
needs no operator dependencies and `disagg --help` stays fast."""
from __future__ import annotations

import sys
from typing import Any

# subcommand -> (module, one-line help). Each module exposes add_arguments(parser) and run(args) -> int.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "generate": ("disagg.worker.engine.generate_cli", "generate text offline with the engine"),
    "fetch-model": ("disagg.worker.model.fetch", "download a checkpoint (Hugging Face Hub, http(s) archive, s3://)"),
    "worker": ("disagg.worker.server.cli", "run an OpenAI-compatible worker (prefill, decode or both)"),
    "router": ("disagg.worker.router.cli", "run the prefill/decode router"),
    "pd-proxy": ("disagg.worker.router.pd_proxy", "front a vLLM worker in its pod: signed hand-offs, the "
                 "decode side's prefill hop, /ready"),
    "epp": ("disagg.worker.gateway.epp", "run the endpoint picker a Gateway API inference gateway calls"),
    "up": ("disagg.worker.local.launcher", "run a DisaggregatedInference spec as local processes"),
    "operator": ("disagg.operator.cli", "run the Kubernetes operator"),
    "crd": ("disagg.operator.crd", "write the CRD YAML generated from the spec models"),
    "validate": ("disagg.operator.validate", "validate a DisaggregatedInference file offline"),
}


def build_parser(argv: list[str], parser_class: type | None = None) -> Any:
    """The `disagg` parser with the chosen subcommand's arguments (only that module is imported).
    `parser_class`: an ArgumentParser subclass, e.g. one whose error() raises (the contract tests)."""
    import argparse
    import importlib

    parser = (parser_class or argparse.ArgumentParser)(prog="disagg",
                                                       description="Disaggregated prefill/decode LLM serving")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        if name == chosen:
            try:
                module = importlib.import_module(module_name)
            except ModuleNotFoundError as e:
                parser.error(f"'disagg {name}' is not available: missing module {e.name}")
            module.add_arguments(p)
            p.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(argv).parse_args(argv)
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
