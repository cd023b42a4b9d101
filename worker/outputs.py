"""Plain dataclasses that cross the scheduler / model-runner / connector boundaries, and what a connector
reads of a request (`ConnectorRequest`).

Below engine/, runner/ and kv_transfer/: each of them imports these, none imports another's internals for
them. Lists and dicts only - no tensors - so they can be pickled between processes (vLLM V1 style).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from disagg.worker.kv_transfer.handoff import Handoff


class FinishStatus(Protocol):
    @property
    def finish_reason(self) -> str | None: ...  # stop | length | abort | error; None while unfinished


class ConnectorRequest(Protocol):
    """What the scheduler-side connector reads of a request; the engine's Request is one."""

    request_id: str
    prompt_token_ids: list[int]
    kv_transfer_params: Handoff | None  # the P/D hand-off, None without one

    @property
    def status(self) -> FinishStatus: ...

    @property
    def num_prompt_tokens(self) -> int: ...

    @property
    def num_output_tokens(self) -> int: ...


@dataclass
class KVConnectorOutput:
    """Everything the worker-side connector reports for one step, gathered in one place."""

    finished_sending: set[str] | None = None  # req ids whose KV was fully pulled by a remote reader
    finished_recving: set[str] | None = None  # req ids whose remote KV finished loading locally
    invalid_block_ids: set[int] = field(default_factory=set)  # local block ids whose load failed
    kv_connector_stats: dict[str, Any] | None = None  # connector-specific counters for this step

    def is_empty(self) -> bool:
        return (
            not self.finished_sending
            and not self.finished_recving
            and not self.invalid_block_ids
            and not self.kv_connector_stats
        )


@dataclass
class TokenLogprobs:
    """One position's log-probabilities (log-softmax of the model's raw logits)."""

    token_id: int  # the sampled (or, for a prompt position, the given) token
    logprob: float
    rank: int  # 1 = the most likely token
    top: list[tuple[int, float]] = field(default_factory=list)  # the top-k (token id, logprob), best first


@dataclass
class NewRequestData:
    """A request scheduled for the first time (or again after preemption)."""

    req_id: str
    prompt_token_ids: list[int]  # full prompt
    block_ids: list[int]  # the request's whole block table so far
    num_computed_tokens: int  # tokens whose KV is already in the cache (prefix hit / remote load)
    sampling_params: Any  # SamplingParams
    num_prompt_tokens: int | None = None  # None: all of prompt_token_ids (else the rest were generated)
    forced_output_ids: tuple[int, ...] = ()  # output i is forced_output_ids[i] (Request.forced_output_ids)


@dataclass
class CachedRequestData:
    """A request that already ran in an earlier step (the runner keeps its tokens: it sampled them)."""

    req_id: str
    new_block_ids: list[int]  # blocks appended to the block table this step
    num_computed_tokens: int


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]  # req_id -> tokens to compute this step
    total_num_scheduled_tokens: int
    finished_req_ids: set[str]  # finished since the previous step; runner and connector drop state
    preempted_req_ids: set[str] = field(default_factory=set)  # runner must forget these
    kv_connector_metadata: Any = None  # built by the scheduler-side connector, bound to the worker side


@dataclass
class EngineCoreOutput:
    """One request's progress in a step, scheduler -> output processor."""

    req_id: str
    new_token_ids: list[int]  # tokens appended this step
    finish_reason: str | None = None  # stop | length | abort | error
    stop_reason: int | str | None = None  # the stop token id or string
    kv_transfer_params: Handoff | None = None  # for the decode side (P/D), set on finish
    error: str | None = None  # with finish_reason "error"
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache or remote KV, not computed here
    logprobs: list[TokenLogprobs] | None = None  # one per new token, when the request asks for logprobs
    # (start, entries): logprobs of prompt tokens start+1 .. computed this step
    prompt_logprobs: tuple[int, list[TokenLogprobs]] | None = None


@dataclass
class ModelRunnerOutput:
    req_ids: list[str]  # requests that ran this step, in batch order
    sampled_token_ids: dict[str, list[int]]  # req_id -> tokens sampled (empty for a partial prefill)
    kv_connector_output: KVConnectorOutput | None = None  # None when there is no connector
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)  # req_id -> per sampled token
    # req_id -> (start position, this step's chunk of prompt logprobs)
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] = field(default_factory=dict)

    @classmethod
    def empty(cls, kv_connector_output: KVConnectorOutput | None = None) -> "ModelRunnerOutput":
        return cls(req_ids=[], sampled_token_ids={}, kv_connector_output=kv_connector_output)
