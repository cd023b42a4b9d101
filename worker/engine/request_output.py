"""What the engine gives its callers for a request: RequestOutput (text, token ids, finish, timing), as vLLM's."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from disagg.worker.outputs import TokenLogprobs


@dataclass
class CompletionOutput:
    index: int
    text: str  # all text so far (stop string excluded)
    token_ids: list[int]  # all generated token ids so far
    finish_reason: str | None = None  # stop | length | abort | error
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprobs] | None = None  # one per token id, when the request asks for logprobs


@dataclass
class RequestMetrics:
    arrival_time: float  # time.monotonic()
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    new_token_ids: list[int] = field(default_factory=list)  # tokens added by this output (streaming)
    new_text: str = ""  # text added by this output (streaming)
    kv_transfer_params: dict[str, Any] | None = None  # P/D: hand to the decode worker (Handoff.to_wire())
    error: str | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache or remote KV
    metrics: RequestMetrics | None = None
    # with prompt_logprobs: one per prompt token, None for the first (nothing predicts it)
    prompt_logprobs: list[TokenLogprobs | None] | None = None
