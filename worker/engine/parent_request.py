"""n > 1: one client request fans out into n child requests (vLLM's ParentRequest idea).

Child i is `{parent}#c{i}`; with a seed, child i samples with seed + i (distinct, reproducible choices). Only
child 0 computes (or loads, with P/D) the prompt; the others wait for it and share its full KV blocks via the
prefix cache (ref counts), so the prompt's KV is computed or transferred once. Outputs go back under the
parent's id, each with its choice index; the parent is finished when every child is.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from disagg.worker.engine.request import Request
from disagg.worker.kv_transfer.handoff import Handoff
from disagg.worker.sampling_params import SamplingParams


@dataclass
class ParentRequest:
    request_id: str
    n: int
    unfinished: set[int] = field(default_factory=set)

    def child_id(self, index: int) -> str:
        return f"{self.request_id}#c{index}"

    def child_params(self, sp: SamplingParams, index: int) -> SamplingParams:
        seed = None if sp.seed is None else sp.seed + index
        # the prompt's logprobs are the same for every choice: child 0 computes them
        prompt_logprobs = sp.prompt_logprobs if index == 0 else None
        return dataclasses.replace(sp, n=1, seed=seed, prompt_logprobs=prompt_logprobs)


class ParentRequests:
    """child id -> (parent, index), for the engine's fan-out and fan-in."""

    def __init__(self) -> None:
        self._parents: dict[str, ParentRequest] = {}
        self._children: dict[str, tuple[ParentRequest, int]] = {}

    def add(self, request_id: str, n: int) -> ParentRequest:
        parent = ParentRequest(request_id, n, set(range(n)))
        self._parents[request_id] = parent
        for i in range(n):
            self._children[parent.child_id(i)] = (parent, i)
        return parent

    def make_requests(self, request_id: str, token_ids: list[int], sp: SamplingParams, eos_token_ids: frozenset[int],
                      handoff: Handoff | None, delivered: tuple[int, ...]) -> list[Request]:
        """The engine requests of one client request: itself when n == 1, else its n children (child 0 carries
        the hand-off; the others wait for its prompt KV). delivered: its first output tokens, already chosen."""
        if sp.n == 1:
            req = Request(request_id, token_ids, sp, eos_token_ids, handoff)
            req.forced_output_ids = delivered
            return [req]
        parent = self.add(request_id, sp.n)
        children = []
        for i in range(sp.n):
            child = Request(parent.child_id(i), token_ids, parent.child_params(sp, i), eos_token_ids,
                            handoff if i == 0 else None)
            child.wait_for = parent.child_id(0) if i else None
            children.append(child)
        return children

    def children_of(self, request_id: str) -> list[str]:
        parent = self._parents.get(request_id)
        return [request_id] if parent is None else [parent.child_id(i) for i in range(parent.n)]

    def resolve(self, child_id: str, finished: bool) -> tuple[str, int, bool]:
        """(client request id, choice index, whether the whole request is finished now)."""
        entry = self._children.get(child_id)
        if entry is None:
            return child_id, 0, finished
        parent, index = entry
        if finished:
            parent.unfinished.discard(index)
            del self._children[child_id]
            if not parent.unfinished:
                del self._parents[parent.request_id]
        return parent.request_id, index, not parent.unfinished
