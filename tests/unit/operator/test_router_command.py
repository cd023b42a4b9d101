"""Contract: every router command the operator's pods and `disagg up` run parses with the router's own parser,
and says what the spec and the placement say. Both come from router_command.build_router_command."""
from __future__ import annotations

import argparse
import copy
import itertools
from pathlib import Path
from typing import Any

import pytest
import yaml

from disagg.operator import manifests as m
from disagg.operator import naming
from disagg.operator import spec as s
from disagg.operator.checks import check_spec
from disagg.worker.local import launcher
from disagg.worker.router import cli as router_cli

ROOT = Path(__file__).resolve().parents[3]
BASES = {engine: yaml.safe_load((ROOT / "examples" / f"llama3-8b-{name}.yaml").read_text())["spec"]
         for engine, name in (("disagg", "gpu"), ("vllm", "vllm"))}
OWNER = m.Owner(name="llama", namespace="serving", uid="0000-1111")
POLICIES = ("least-loaded", "round-robin", "prefix-aware")
ROUTERS = {
    "defaults": {},
    "bounds": {"timeouts": {"connectSeconds": 2, "firstByteSeconds": 30, "idleSeconds": 10, "requestSeconds": 90,
                            "unresponsiveSeconds": 0},
               "outlierDetection": {"consecutiveFailures": 3, "baseEjectionSeconds": 4, "maxEjectionSeconds": 40},
               "prefixAware": {"loadCostTokens": 96, "skipPrefillBlocks": 5},
               "admission": {"queueWaitSeconds": 0.25, "maxRequestBodyBytes": 4096, "maxInFlightPerEndpoint": 48}},
    "extra-args": {"extraArgs": ["--log-level", "DEBUG", "--no-early-first-token"]},
    "auth-tls": {"auth": {"secretName": "client-keys"}, "tls": {"secretName": "router-tls"}},
}
TARGETS = ("kubernetes", "local-static", "local-file")
VARIANTS = list(itertools.product(POLICIES, BASES, (False, True), ROUTERS, TARGETS))


class _Rejected(Exception):
    pass


class _RaisingParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise _Rejected(message)


def parse_like_the_router(argv: list[str]) -> argparse.Namespace:
    """`disagg router ...` as the router parses it (argv[0] is the image's `disagg` or this interpreter)."""
    assert argv[argv.index("router") - 1] in ("disagg", "disagg.worker.cli"), argv
    parser = _RaisingParser(prog="disagg router")
    router_cli.add_arguments(parser)
    return parser.parse_args(argv[argv.index("router") + 1:])


def spec_for(policy: str, engine: str, autoscaling: bool, router: str) -> s.DisaggregatedInferenceSpec:
    raw = copy.deepcopy(BASES[engine])
    raw["router"] = {**copy.deepcopy(ROUTERS[router]), "policy": policy}
    raw["autoscaling"] = {**raw.get("autoscaling", {}), "enabled": autoscaling}
    spec, problems = check_spec(raw, "kubernetes")
    assert spec is not None and problems == [], problems
    return spec


def router_command(spec: s.DisaggregatedInferenceSpec, target: str) -> tuple[list[str], list[Any]]:
    """(the router's argv, the worker processes it is given) as the target runs it."""
    if target == "kubernetes":
        pod = m.build_router_deployment(OWNER, spec)["spec"]["template"]["spec"]
        [container] = pod["containers"]
        return [*container["command"], *container["args"]], []
    ports = iter(range(20000, 20200))
    procs = launcher.plan(spec, "/ckpt", "127.0.0.1", 8100, lambda: next(ports), "/kv",
                          endpoints_file="/logs/endpoints.json" if target == "local-file" else None,
                          vllm_executable="/bin/true").processes
    assert procs[-1].role == "router"
    return procs[-1].argv, procs[:-1]


@pytest.mark.parametrize("policy, engine, autoscaling, router, target", VARIANTS,
                         ids=["-".join(map(str, v)) for v in VARIANTS])
def test_every_router_command_parses_with_the_routers_parser(policy, engine, autoscaling, router, target):
    spec = spec_for(policy, engine, autoscaling, router)
    argv, workers = router_command(spec, target)
    args = parse_like_the_router(argv)
    r = spec.router
    assert args.policy == policy
    assert (args.connect_timeout, args.first_byte_timeout, args.idle_timeout, args.request_timeout) == (
        r.timeouts.connect_seconds, r.timeouts.first_byte_seconds, r.timeouts.idle_seconds,
        r.timeouts.request_seconds)
    assert args.unresponsive_after == r.timeouts.unresponsive_after(engine)
    assert (args.eject_after_failures, args.ejection_seconds, args.max_ejection_seconds) == (
        r.outlier_detection.consecutive_failures, r.outlier_detection.base_ejection_seconds,
        r.outlier_detection.max_ejection_seconds)
    assert (args.prefix_load_cost_tokens, args.prefix_skip_prefill_blocks) == (
        r.prefix_aware.load_cost_tokens, r.prefix_aware.skip_prefill_blocks)
    assert (args.queue_wait, args.max_request_body_bytes) == (
        r.admission.queue_wait_seconds, r.admission.max_request_body_bytes)
    # unset: what one of the examples' decode workers takes at once (--max-num-seqs 256, and an eighth waiting);
    # vLLM's waiting queue has no bound, nor has the router's per worker then
    assert args.max_in_flight_per_endpoint == (48 if router == "bounds" else 256 + 32 if engine == "disagg" else 0)
    assert args.log_level == ("DEBUG" if router == "extra-args" else "INFO")
    assert args.early_first_token is (router != "extra-args")
    if target == "kubernetes":
        assert (args.host, args.port) == ("0.0.0.0", naming.HTTP_PORT)
        assert (args.discovery, args.namespace) == ("kubernetes", OWNER.namespace)
        assert args.prefill_selector == naming.label_selector(OWNER.name, "prefill")
        assert args.decode_selector == naming.label_selector(OWNER.name, "decode")
        events = (args.kv_events_port, args.kv_events_replay_port, args.kv_events_topic)
        assert events == ((*naming.KV_EVENTS_PORTS, naming.KV_EVENTS_TOPIC) if policy == "prefix-aware"
                          else (None, None, ""))
        # spec.router.tls: the Secret's files where the pod mounts it
        assert (args.tls_cert_file, args.tls_key_file) == (
            ("/etc/disagg/tls/tls.crt", "/etc/disagg/tls/tls.key") if router == "auth-tls" else (None, None))
        return
    # disagg up: its own interpreter, loopback, the launcher's probe interval; the workers announce their
    # KV-events ports in the endpoints file
    assert (args.host, args.port, args.probe_interval) == ("127.0.0.1", 8100, launcher.ROUTER_PROBE_INTERVAL_S)
    assert (args.kv_events_port, args.kv_events_replay_port) == (None, None)
    if target == "local-file":
        assert (args.discovery, args.endpoints_file, args.prefill, args.decode) == (
            "file", "/logs/endpoints.json", [], [])
    else:
        assert args.discovery == "static"
        assert args.prefill == [w.url for w in workers if w.role == "prefill"]
        assert args.decode == [w.url for w in workers if w.role == "decode"] != []


@pytest.mark.parametrize("target", TARGETS)
def test_scale_to_zero_makes_the_router_hold_requests(target):
    spec = spec_for("least-loaded", "disagg", True, "defaults")
    assert parse_like_the_router(router_command(spec, target)[0]).hold_seconds == 0  # off by default: no hold
    zero = spec.model_copy(update={"autoscaling": spec.autoscaling.model_copy(update={
        "scale_to_zero": s.ScaleToZero(enabled=True, hold_seconds=45, max_held_requests=7)})})
    args = parse_like_the_router(router_command(zero, target)[0])
    assert (args.hold_seconds, args.max_held_requests) == (45, 7)


@pytest.mark.parametrize("engine, args, waiting, bound", [
    ("disagg", [], None, 64 + 8),  # the worker's defaults
    ("disagg", ["--max-num-seqs", "16"], None, 16 + 2), ("disagg", ["--max-num-seqs=16"], 5, 16 + 5),
    ("vllm", [], None, 0), ("vllm", ["--max-num-seqs", "100"], None, 0),  # vLLM queues without a bound
])
def test_the_routers_bound_defaults_to_what_a_decode_worker_takes_at_once(engine, args, waiting, bound):
    raw = copy.deepcopy(BASES[engine])
    raw["decode"]["extraArgs"] = args
    raw["engineArgs"] = ["--max-num-seqs", "999"] if args else []  # the role's flag comes later and wins
    if waiting is not None:
        raw["decode"]["admission"] = {"maxWaitingRequests": waiting}
    spec, problems = check_spec(raw, "kubernetes")
    assert spec is not None and problems == [], problems
    argv, _ = router_command(spec, "kubernetes")
    assert parse_like_the_router(argv).max_in_flight_per_endpoint == bound
