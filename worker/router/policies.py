"""The routing policies by name: the one list `disagg router --policy` and the CRD's spec.router.policy take.

Each policy is a RoutingPolicy (policy.py); its tunables come from PolicySettings (the router's flags)."""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from disagg.worker.router.policy import Candidate, RoutingPolicy, rank_by_load
from disagg.worker.router.prefix_policy import PrefixAware, PrefixPolicyConfig


@dataclass(frozen=True)
class LeastLoaded(RoutingPolicy):
    """The fewest requests in flight (this router's, or the worker's own count), then the lowest KV usage."""
    name = "least-loaded"

    def rank(self, candidates: Sequence[Candidate], turn: int,
             costs: Mapping[str, float] | None = None) -> list[Candidate]:
        return rank_by_load(candidates, turn, costs)


@dataclass(frozen=True)
class RoundRobin(RoutingPolicy):
    """Each pick the next one; weighs nothing (no /metrics scraped)."""
    name = "round-robin"
    weighs_load = False

    def rank(self, candidates: Sequence[Candidate], turn: int,
             costs: Mapping[str, float] | None = None) -> list[Candidate]:
        r = turn % len(candidates) if candidates else 0
        return [*candidates[r:], *candidates[:r]]


@dataclass(frozen=True)
class PolicySettings:
    """Every policy's tunables (the router's flags; spec.router.* on the operator's side), each built and checked
    only by the policy that uses it: a flag of a policy not in use is not read."""
    prefix: Callable[[], PrefixPolicyConfig] = PrefixPolicyConfig


# name -> the policy built from the settings; the order is the CRD enum's
POLICIES: dict[str, Callable[[PolicySettings], RoutingPolicy]] = {
    LeastLoaded.name: lambda settings: LeastLoaded(),
    RoundRobin.name: lambda settings: RoundRobin(),
    PrefixAware.name: lambda settings: PrefixAware(settings.prefix()),
}
POLICY_NAMES = tuple(POLICIES)
DEFAULT_POLICY = LeastLoaded.name


def make_policy(name: str, settings: PolicySettings | None = None) -> RoutingPolicy:
    try:
        build = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown routing policy {name!r}: expected one of {', '.join(POLICY_NAMES)}") from None
    return build(settings or PolicySettings())
