"""The routing policy's interface (pure; no I/O, the turn injected): what one pick weighs and what a policy decides.

A policy answers two questions, each a pure function of its inputs:
- `plan`, once per request: from the prompt (its length and full blocks; None when it is not known) and the
  candidates' facts (load, KV usage, revision, cached prefix), the per-role costs and whether the decode endpoint
  can do without the prefill hop;
- `rank`, once per pick (a retry picks again): the candidates in the order to try them. `turn` counts the pool's
  picks, so ties rotate and load spreads evenly.
What every policy shares stays outside them, in endpoints.EndpointPool: which endpoints are candidates at all (ready,
not ejected: outliers.py) and the revision pairing (prefer the prefill's serving revision). The registry
(policies.py) names the policies; the router's hops and the gateway's endpoint picker call them through the pools.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

DEFAULT_BLOCK_SIZE = 16  # the workers' default, for endpoints that have not announced a block yet


@dataclass(frozen=True)
class Candidate:
    """What a policy knows of one endpoint for one pick."""
    url: str
    hit_blocks: int = 0  # leading full blocks of the prompt it holds (by its KV events); 0: none, or not known
    block_size: int = DEFAULT_BLOCK_SIZE  # tokens per block
    load: float = 0.0  # requests in flight (this router's or its own count, whichever is larger)
    kv_usage: float = 0.0  # 0..1
    revision: str | None = None  # serving revision (pod label)

    @property
    def hit_tokens(self) -> int:
        return self.hit_blocks * self.block_size


@dataclass(frozen=True)
class Prompt:
    tokens: int  # the prompt's length in tokens
    full_blocks: dict[int, int] = field(default_factory=dict)  # block size -> its full blocks an engine may hit


@dataclass
class RoutePlan:
    """One request's plan. Without costs each pick ranks by the policy's own rule (load, or turn)."""
    decode_costs: dict[str, float] | None = None  # url -> cost; the cheapest available goes first
    prefill_costs: dict[str, float] | None = None
    skip_prefill: bool = False  # the decode endpoint computes the few missing blocks itself
    prompt_tokens: int = 0
    decode_url: str | None = None  # the cheapest decode endpoint when planned
    decode_hit_tokens: int = 0  # its cached prefix


class RoutingPolicy(ABC):
    name: ClassVar[str]  # the registry's key, `disagg router --policy` and spec.router.policy
    weighs_load: ClassVar[bool] = True  # ranks by the workers' /metrics (the router's probes scrape them)
    reads_prefixes: ClassVar[bool] = False  # plans from the prompt's cached prefixes (tokenizer, KV events)

    def plan(self, prompt: Prompt | None, decode: Sequence[Candidate], prefill: Sequence[Candidate]) -> RoutePlan:
        return RoutePlan()

    @abstractmethod
    def rank(self, candidates: Sequence[Candidate], turn: int,
             costs: Mapping[str, float] | None = None) -> list[Candidate]:
        """All candidates, the one to try first first; `costs` from this request's plan."""


def rank_by_key(candidates: Sequence[Candidate], turn: int, key: Callable[[Candidate], tuple]) -> list[Candidate]:
    """Ascending by key; each run of equal keys rotated by `turn`, so exact ties take turns."""
    ordered = sorted(candidates, key=key)  # stable: a tie keeps the pool's order before it is rotated
    out: list[Candidate] = []
    while ordered:
        n = next((i for i, c in enumerate(ordered) if key(c) != key(ordered[0])), len(ordered))
        tie, ordered = ordered[:n], ordered[n:]
        r = turn % len(tie)
        out += tie[r:] + tie[:r]
    return out


def rank_by_load(candidates: Sequence[Candidate], turn: int,
                 costs: Mapping[str, float] | None = None) -> list[Candidate]:
    """The cheapest first by `costs` (an endpoint without one costs infinity), then the least loaded, then the
    lowest KV usage."""
    if costs is None:
        return rank_by_key(candidates, turn, lambda c: (c.load, c.kv_usage))
    return rank_by_key(candidates, turn, lambda c: (costs.get(c.url, float("inf")), c.load, c.kv_usage))
