"""Engine-core outputs (token ids) -> the callers' RequestOutputs (vLLM's output processor): per request, text
(incremental detokenizing), stop strings, logprobs and timing; per step, finishing what a stop string ended,
folding n choices back into their client request, and counting prompt and generation tokens."""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from disagg.worker.engine.parent_request import ParentRequests
from disagg.worker.engine.request import Request
from disagg.worker.engine.request_output import CompletionOutput, RequestMetrics, RequestOutput
from disagg.worker.engine.stats import EngineStats
from disagg.worker.model.tokenizer import IncrementalDetokenizer
from disagg.worker.outputs import EngineCoreOutput, TokenLogprobs


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
    def __init__(self, tokenizer: Any, parents: ParentRequests, stats: EngineStats):
        self.tokenizer = tokenizer
        self.parents = parents  # n > 1: child -> client request
        self.stats = stats  # prompt and generation token counters
        self._states: dict[str, _RequestState] = {}

    def add_request(self, req: Request, prompt: str | None) -> None:
        self._states[req.request_id] = _RequestState(req, prompt, self.tokenizer)

    def process_outputs(self, core_outputs: list[EngineCoreOutput],
                        finish_stopped: Callable[[str], dict[str, Any] | None]) -> list[RequestOutput]:
        """One step's outputs for the callers. finish_stopped(req_id): the scheduler finishes a request a stop
        string ended and returns its hand-off for the decode side (wire form), if any."""
        outputs = []
        for out in core_outputs:
            self.stats.generation_tokens += len(out.new_token_ids)
            ro = self.process(out)
            if ro is None:
                continue
            if ro.finished and out.finish_reason is None:  # stopped by a stop string
                ro.kv_transfer_params = finish_stopped(out.req_id)
            ro.request_id, ro.outputs[0].index, ro.finished = self.parents.resolve(out.req_id, ro.finished)
            if (out.new_token_ids and len(ro.outputs[0].token_ids) == len(out.new_token_ids)
                    and ro.outputs[0].index == 0):
                self.stats.prompt_tokens += len(ro.prompt_token_ids)  # counted at its first token, as vLLM
            outputs.append(ro)
        return outputs

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
