"""Turns engine-core outputs (token ids) into user-facing RequestOutputs: text, stop strings, timing."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from disagg.worker.engine.request import Request
from disagg.worker.outputs import EngineCoreOutput, TokenLogprobs
from disagg.worker.model.tokenizer import IncrementalDetokenizer


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


class _RequestState:
    def __init__(self, req: Request, prompt: str | None, tokenizer: Any):
        self.req = req
        self.prompt = prompt
        self.token_ids: list[int] = []
        sp = req.sampling_params
        # O(1) work per token
        self.detokenizer = IncrementalDetokenizer(tokenizer, req.prompt_token_ids, sp.skip_special_tokens)
        self.logprobs: list[TokenLogprobs] | None = [] if sp.logprobs is not None else None
        self.prompt_logprobs: list[TokenLogprobs | None] | None = [None] if sp.prompt_logprobs is not None else None
        self.text = ""  # text released to the client
        self.metrics = RequestMetrics(arrival_time=req.arrival_time)
        self.finished = False


class OutputProcessor:
    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self._states: dict[str, _RequestState] = {}

    def add_request(self, req: Request, prompt: str | None) -> None:
        self._states[req.request_id] = _RequestState(req, prompt, self.tokenizer)

    def process(self, out: EngineCoreOutput) -> RequestOutput | None:
        state = self._states.get(out.req_id)
        if state is None or state.finished:
            return None
        now = time.monotonic()
        if out.new_token_ids:
            if state.metrics.first_token_time is None:
                state.metrics.first_token_time = now
            state.metrics.last_token_time = now
        state.token_ids.extend(out.new_token_ids)
        sp = state.req.sampling_params
        _collect_logprobs(state, out)
        for token_id in out.new_token_ids:
            state.detokenizer.add(token_id)
        if out.finish_reason is not None:
            state.detokenizer.finish()  # release a held-back partial character
        full = state.detokenizer.text
        finish_reason, stop_reason = out.finish_reason, out.stop_reason
        text = full
        for stop in sp.stop:
            at = full.find(stop, max(0, len(state.text) - len(stop)))
            if at != -1:
                end = at + len(stop) if sp.include_stop_str_in_output else at
                text, finish_reason, stop_reason = full[:end], "stop", stop
                break
        finished = finish_reason is not None
        if not finished:
            # hold back what could be the start of a stop string (the detokenizer holds partial characters)
            hold = max((len(s) - 1 for s in sp.stop), default=0)
            if hold:
                text = text[: max(len(state.text), len(text) - hold)]
        new_text = text[len(state.text):] if text.startswith(state.text) else text
        state.text = text
        if finished:
            state.finished = True
            state.metrics.finished_time = now
            del self._states[out.req_id]
        return RequestOutput(
            request_id=out.req_id,
            prompt=state.prompt,
            prompt_token_ids=state.req.prompt_token_ids,
            outputs=[CompletionOutput(0, state.text, list(state.token_ids), finish_reason, stop_reason,
                                      list(state.logprobs) if state.logprobs is not None else None)],
            finished=finished,
            new_token_ids=list(out.new_token_ids),
            new_text=new_text,
            kv_transfer_params=out.kv_transfer_params.to_wire() if out.kv_transfer_params is not None else None,
            error=out.error,
            num_cached_tokens=out.num_cached_tokens,
            metrics=state.metrics,
            prompt_logprobs=state.prompt_logprobs,
        )


def _collect_logprobs(state: _RequestState, out: EngineCoreOutput) -> None:
    if state.logprobs is not None and out.logprobs:
        state.logprobs.extend(out.logprobs[: len(out.new_token_ids)])
    prompt = state.prompt_logprobs
    if prompt is not None and out.prompt_logprobs:
        start, entries = out.prompt_logprobs
        if start + 1 == len(prompt):  # the next chunk; a recompute after a preemption sends known ones again
            prompt.extend(entries)
