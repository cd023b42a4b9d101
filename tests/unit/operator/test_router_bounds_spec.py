"""spec.router.timeouts, outlierDetection and prefixAware reach the router the same way on Kubernetes and in
`disagg up`, and values that contradict each other are named."""
from __future__ import annotations

import copy
from pathlib import Path

import yaml

from disagg.operator import manifests as m
from disagg.operator import spec as s
from disagg.operator.checks import check_spec
from disagg.operator.router_command import bound_args
from disagg.worker.local.launcher import plan
from disagg.worker.router import cli as router_cli

ROOT = Path(__file__).resolve().parents[3]
BASE = yaml.safe_load((ROOT / "examples" / "llama3-8b-gpu.yaml").read_text())["spec"]
OWNER = m.Owner(name="llama", namespace="serving", uid="0000-1111")
ROUTER = {"timeouts": {"connectSeconds": 2, "firstByteSeconds": 30, "idleSeconds": 10, "requestSeconds": 90,
                       "unresponsiveSeconds": 20},
          "outlierDetection": {"consecutiveFailures": 3, "baseEjectionSeconds": 4, "maxEjectionSeconds": 40},
          "prefixAware": {"loadCostTokens": 96, "skipPrefillBlocks": 5}}
WANT = {"connect_timeout": 2.0, "first_byte_timeout": 30.0, "idle_timeout": 10.0, "request_timeout": 90.0,
        "unresponsive_after": 20.0,
        "eject_after_failures": 3, "ejection_seconds": 4.0, "max_ejection_seconds": 40.0,
        "prefix_load_cost_tokens": 96.0, "prefix_skip_prefill_blocks": 5}


def parsed_router_args(argv: list[str]) -> dict:
    import argparse

    p = argparse.ArgumentParser()
    router_cli.add_arguments(p)
    args = vars(p.parse_args(argv[argv.index("router") + 1:]))
    return {k: args[k] for k in WANT}


def test_router_bounds_reach_the_router_pod_and_the_local_router():
    spec = s.parse_spec({**copy.deepcopy(BASE), "router": ROUTER})
    dep = m.build_router_deployment(OWNER, spec)
    assert parsed_router_args(dep["spec"]["template"]["spec"]["containers"][0]["args"]) == WANT
    ports = iter(range(9000, 9100))
    local = plan(spec, "/ckpt", "127.0.0.1", 8000, lambda: next(ports), "/kv").processes[-1].argv
    assert parsed_router_args(local) == WANT


def test_defaults_are_the_routers_own():
    spec = s.parse_spec(copy.deepcopy(BASE))
    defaults = parsed_router_args(["router"])
    assert parsed_router_args(["router", *bound_args(spec.router, "disagg")]) == defaults


def test_vllm_workers_get_longer_to_answer_their_probes_unless_the_spec_says():
    """A CPU-starved vLLM left /health unanswered for 27 s while it served; the router's default of 8 s then
    abandoned its requests with 504s. With engine vllm the default is 60 s; an explicit value wins for both."""
    spec = s.parse_spec({**copy.deepcopy(BASE), "engine": "vllm"})
    args = m.build_router_deployment(OWNER, spec)["spec"]["template"]["spec"]["containers"][0]["args"]
    assert parsed_router_args(args)["unresponsive_after"] == 60.0
    assert parsed_router_args(["router", *bound_args(spec.router, "disagg")])["unresponsive_after"] == 8.0
    spec = s.parse_spec({**copy.deepcopy(BASE), "engine": "vllm", "router": {"timeouts": {"unresponsiveSeconds": 0}}})
    assert parsed_router_args(["router", *bound_args(spec.router, "vllm")])["unresponsive_after"] == 0.0


def test_contradicting_bounds_are_named():
    raw = {**copy.deepcopy(BASE), "router": {"timeouts": {"idleSeconds": 700},
                                             "outlierDetection": {"baseEjectionSeconds": 60,
                                                                  "maxEjectionSeconds": 30}}}
    _, problems = check_spec(raw, "local")
    fields = {p.path for p in problems}
    assert {"spec.router.timeouts.idleSeconds", "spec.router.outlierDetection.maxEjectionSeconds"} <= fields


def test_the_router_pod_outlives_its_drain_with_a_prestop_sleep_first():
    """preStop sleep (the Service drops the pod meanwhile), then the router's own drain: /ready 503 for
    --drain-delay, open requests for --drain-timeout, their error events; the grace period covers all of it (the
    Kubernetes default of 30 s cut the router's 120 s drain with a SIGKILL)."""
    from disagg.worker.router.draining import CUT_GRACE_S

    spec = s.parse_spec(copy.deepcopy(BASE))
    pod = m.build_router_deployment(OWNER, spec)["spec"]["template"]["spec"]
    container = pod["containers"][0]
    sleep = int(container["lifecycle"]["preStop"]["exec"]["command"][1])
    p = __import__("argparse").ArgumentParser()
    router_cli.add_arguments(p)
    args = p.parse_args(container["args"][container["args"].index("router") + 1:])
    assert pod["terminationGracePeriodSeconds"] > sleep + args.drain_delay + args.drain_timeout + CUT_GRACE_S
    longer = s.parse_spec({**copy.deepcopy(BASE), "router": {"extraArgs": ["--drain-timeout", "600"]}})
    assert m.build_router_deployment(OWNER, longer)["spec"]["template"]["spec"][
        "terminationGracePeriodSeconds"] > sleep + args.drain_delay + 600 + CUT_GRACE_S
