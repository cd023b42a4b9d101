"""The routing policies, table-driven: each one's order for a pick (the turn injected), the prefix-aware plan, the
rules every policy shares (ejection, revision pairing), and the registry as the one list of names."""
from __future__ import annotations

import argparse
import typing
from pathlib import Path

import pytest
import yaml

from disagg.worker.router import cli as router_cli
from disagg.worker.router.endpoints import EndpointPool
from disagg.worker.router.outliers import OutlierPolicy
from disagg.worker.router.policies import DEFAULT_POLICY, POLICY_NAMES, PolicySettings, make_policy
from disagg.worker.router.policy import Candidate, Prompt, RoutePlan
from disagg.worker.router.prefix_policy import PrefixAware, PrefixPolicyConfig, plan_route

ROOT = Path(__file__).resolve().parents[3]
A, B, C = Candidate("a", load=2), Candidate("b", load=0, kv_usage=0.5), Candidate("c", load=0, kv_usage=0.5)

# (policy, candidates, turn, costs, expected order of urls)
RANKS = {
    "round-robin: turn 0 keeps the order": ("round-robin", [A, B, C], 0, None, "abc"),
    "round-robin: each turn the next": ("round-robin", [A, B, C], 4, None, "bca"),
    "round-robin ignores load": ("round-robin", [B, A], 1, None, "ab"),
    "least-loaded: the idle ones first, ties take turns": ("least-loaded", [A, B, C], 1, None, "cba"),
    "least-loaded: KV usage breaks a load tie": ("least-loaded", [Candidate("x", 1, kv_usage=0.9),
                                                                  Candidate("y", 1, kv_usage=0.1)], 0, None, "yx"),
    "least-loaded: costs come first": ("least-loaded", [A, B, C], 0, {"a": 1.0, "b": 5.0}, "abc"),
    "prefix-aware: the cheapest first, no cost is infinite": ("prefix-aware", [A, B, C], 0, {"c": 3.0, "a": 9.0},
                                                              "cab"),
    "prefix-aware without costs: by load": ("prefix-aware", [A, B, C], 0, None, "bca"),
}


@pytest.mark.parametrize("name, candidates, turn, costs, want", RANKS.values(), ids=RANKS.keys())
def test_each_policy_orders_a_pick(name, candidates, turn, costs, want):
    assert "".join(c.url for c in make_policy(name).rank(candidates, turn, costs)) == want


def test_prefix_aware_plans_from_the_prompt_and_only_from_it():
    policy = PrefixAware(PrefixPolicyConfig(load_cost_tokens=8.0, skip_prefill_max_missing_blocks=1))
    decode = [Candidate("a", 1, 4), Candidate("b", 4, 4)]
    plan = policy.plan(Prompt(21, {4: 5}), decode, [Candidate("p", 0, 4)])
    assert plan == plan_route(21, {4: 5}, decode, [Candidate("p", 0, 4)], policy.config)
    assert (plan.decode_url, plan.skip_prefill, plan.decode_costs["b"]) == ("b", True, 5.0)
    assert policy.plan(None, decode, []) == RoutePlan()  # no tokens: every pick by load
    for name in ("least-loaded", "round-robin"):
        assert make_policy(name).plan(Prompt(21, {4: 5}), decode, []) == RoutePlan()


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_every_policy_leaves_ejected_endpoints_out_and_pairs_revisions(name):
    now = [0.0]
    pool = EndpointPool("decode", name, outlier_policy=OutlierPolicy(1, 5, 60), clock=lambda: now[0])
    pool.set_urls(["old", "new", "bad"], {"old": "r1", "new": "r2", "bad": "r2"})
    for ep in pool.endpoints.values():
        ep.ready = True
    pool.mark_failed(pool.endpoints["bad"])
    pool.endpoints["bad"].ready = True  # its probe passes again, but it is ejected for 5 s
    assert {pool.pick(revisions={"r2"}).url for _ in range(4)} == {"new"}
    assert {pool.pick(revisions={"r1"}).url for _ in range(4)} == {"old"}
    assert [e.url for e in pool.ranked(exclude={"new"}, revisions={"r2"})] == ["old"]
    now[0] = 6.0
    assert {pool.pick(revisions={"r2"}).url for _ in range(4)} == {"new", "bad"}


def test_the_registry_is_the_one_list_of_names():
    assert POLICY_NAMES == ("least-loaded", "round-robin", "prefix-aware") and DEFAULT_POLICY == "least-loaded"
    parser = argparse.ArgumentParser()
    router_cli.add_arguments(parser)
    (action,) = [a for a in parser._actions if a.dest == "policy"]
    assert tuple(action.choices) == POLICY_NAMES and action.default == DEFAULT_POLICY
    from disagg.operator import spec as s

    assert typing.get_args(s.RouterSpec.model_fields["policy"].annotation) == POLICY_NAMES
    crd = yaml.safe_load((ROOT / "crds" / "disaggregatedinferences.disagg.dev.yaml").read_text())
    router = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["router"]
    assert tuple(router["properties"]["policy"]["enum"]) == POLICY_NAMES


def test_unknown_names_and_bad_tunables_are_named_only_for_the_policy_in_use():
    with pytest.raises(ValueError, match="unknown routing policy 'fastest'.*least-loaded, round-robin, prefix-aware"):
        make_policy("fastest")
    bad = PolicySettings(prefix=lambda: PrefixPolicyConfig(load_cost_tokens=-1))
    assert make_policy("least-loaded", bad).name == "least-loaded"  # the prefix flags are not read
    with pytest.raises(ValueError, match="load_cost_tokens"):
        make_policy("prefix-aware", bad)
