"""One admitted completion / chat request, answered: collected into one body, or streamed as SSE chunks.

n choices arrive as outputs of one engine request (each with its choice index); the request is finished when
every choice is. Logprobs, echo (completions) and vLLM's prompt_logprobs are written per choice.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from disagg.worker.client_disconnect import unless_disconnected
from disagg.worker.outputs import TokenLogprobs
from disagg.worker.engine.request_output import CompletionOutput, RequestOutput
from disagg.worker.server.protocol import APIError, error_body, sse, usage
from disagg.worker.server.responses import (
    Kind, LogprobsWriter, body, choice, delta_choice, prompt_logprobs_json,
)

logger = logging.getLogger(__name__)


@dataclass
class Job:
    kind: Kind
    request_id: str  # the client-visible id (X-Request-Id)
    engine_id: str
    response_id: str
    model: str
    stream: bool
    include_usage: bool
    sink: asyncio.Queue
    tokenizer: Any
    prompt_ids: list[int]
    n: int = 1
    logprobs: bool = False  # the response carries logprobs for each choice
    echo: bool = False  # completions: the prompt (and its logprobs) lead each choice
    prompt_logprobs: bool = False  # vLLM's prompt_logprobs field in the response
    tokens_as_ids: bool = False  # vLLM's return_tokens_as_token_ids
    prompt_str: str | None = None  # the prompt as the client sent it, when it sent text (echo repeats it)
    prompt_lps: list[TokenLogprobs | None] | None = field(default=None, repr=False)
    # P/D: the client already has the first `delivered` tokens (and, in a chat, the role): the router streamed
    # the prefill's answer (kv_transfer_params.delivered_token_ids). A stream sends what follows them
    delivered: int = 0
    handoff_signer: Any = None  # signs the hand-off a prefill answer carries (handoff_auth.py), when a key is set

    def prompt_text(self) -> str:
        if self.prompt_str is not None:
            return self.prompt_str
        return self.tokenizer.decode(self.prompt_ids, skip_special_tokens=False)

    def prompt_entries(self) -> list[tuple[int, TokenLogprobs | None]]:
        lps = self.prompt_lps or [None] * len(self.prompt_ids)
        return list(zip(self.prompt_ids, lps))

    def usage(self, num_generated: int) -> dict[str, int]:
        return usage(len(self.prompt_ids), num_generated)


def observe(loop_: Any, out: RequestOutput, last_token_time: float | None) -> float | None:
    """Metrics for one output; returns the new last-token time (monotonic) for inter-token latency."""
    m, metrics = out.metrics, loop_.metrics
    if m is None or metrics is None:
        return last_token_time
    if out.new_token_ids and m.last_token_time is not None:
        if last_token_time is not None:
            metrics.itl.observe(m.last_token_time - last_token_time)
        last_token_time = m.last_token_time
    if out.finished:
        metrics.observe_finished(m.arrival_time, m.first_token_time, m.finished_time or time.monotonic())
    return last_token_time


def _final_choice(job: Job, c: CompletionOutput) -> dict[str, Any]:
    text, lp = c.text, None
    writer = LogprobsWriter(job.tokenizer, job.kind, as_ids=job.tokens_as_ids)
    if job.kind == "completion":
        entries: list[tuple[int, TokenLogprobs | None]] = []
        if job.echo:
            text = job.prompt_text() + text
            entries = job.prompt_entries()
        if job.logprobs:
            lp = writer.completion(entries + list(zip(c.token_ids, c.logprobs or [])))
    elif job.logprobs:
        lp = writer.chat(c.logprobs or [])
    return choice(job.kind, c.index, text, lp, c.finish_reason, c.stop_reason)


async def complete(loop_: Any, request: Request, job: Job) -> Response:
    async def collect() -> tuple[dict[int, CompletionOutput], RequestOutput | None]:
        finals: dict[int, CompletionOutput] = {}
        last, last_time = None, None
        async for out in loop_.stream(job.sink):
            last, last_time = out, observe(loop_, out, last_time)
            finals[out.outputs[0].index] = out.outputs[0]
            if out.prompt_logprobs is not None and out.outputs[0].index == 0:
                job.prompt_lps = out.prompt_logprobs
        return finals, last

    answered, collected = await unless_disconnected(request, collect())
    if not answered:  # the client went away
        loop_.abort(job.engine_id)
        logger.info("client disconnected; aborted %s", job.engine_id)
        return Response(status_code=499)
    finals, out = collected
    if out is None or not out.finished:
        return JSONResponse(error_body(500, loop_.dead or "engine stopped", "internal_error"), status_code=500)
    if any(c.finish_reason == "error" for c in finals.values()):
        e = APIError(500, out.error or "request failed in the engine", "internal_error")
        return JSONResponse(e.body(), status_code=500)
    choices = [_final_choice(job, finals[i]) for i in sorted(finals)]
    params = out.kv_transfer_params
    if params is not None and job.handoff_signer is not None:
        params = job.handoff_signer.sign_params(params)
    extra: dict[str, Any] = {"usage": job.usage(sum(len(c.token_ids) for c in finals.values())),
                             "kv_transfer_params": params}
    if job.prompt_logprobs:
        extra["prompt_logprobs"] = prompt_logprobs_json(job.tokenizer, job.prompt_ids, job.prompt_lps)
    return JSONResponse(body(job.kind, job.response_id, job.model, choices, **extra),
                        headers={"X-Request-Id": job.request_id})


@dataclass
class _ChoiceStream:
    writer: LogprobsWriter
    sent_logprobs: int = 0
    started: bool = False  # a chunk of this choice went out (chat: the role; completions: the echo)
    num_tokens: int = 0


def _chunk(job: Job, st: _ChoiceStream, out: RequestOutput) -> dict[str, Any] | None:
    """The next chunk of out's choice, or None when it adds nothing yet."""
    c = out.outputs[0]
    st.num_tokens = len(c.token_ids)
    text = "" if st.num_tokens <= job.delivered else out.new_text
    new_lps = (c.logprobs or [])[st.sent_logprobs:] if job.logprobs else []
    want = bool(text or new_lps or c.finish_reason)
    if not st.started and job.kind == "chat":
        want = True  # the first chunk carries the role
    elif not st.started and job.echo:
        want = bool(out.new_token_ids)  # the echo waits for the prompt's logprobs, which come with a token
    if not want:
        return None
    lp = None
    if job.kind == "completion":
        entries = list(zip(c.token_ids[st.sent_logprobs:], new_lps))
        if job.echo and not st.started:
            text, entries = job.prompt_text() + text, job.prompt_entries() + entries
        lp = st.writer.completion(entries) if job.logprobs else None
    elif job.logprobs:
        lp = st.writer.chat(new_lps)
    st.sent_logprobs += len(new_lps)
    first, st.started = not st.started, True
    return body(job.kind, job.response_id, job.model,
                [delta_choice(job.kind, c.index, text, lp, c.finish_reason, first)], chunk=True)


async def _outputs(loop_: Any, job: Job, first: RequestOutput | None) -> AsyncIterator[RequestOutput]:
    """The job's outputs, starting with `first`, already taken from its sink (None: the engine stopped)."""
    if first is None:
        return
    yield first
    if not first.finished:  # (with n > 1: every choice finished)
        async for out in loop_.stream(job.sink):
            yield out


async def stream(loop_: Any, job: Job, first: RequestOutput | None) -> AsyncIterator[bytes]:
    """SSE chunks of a job whose first output the caller took (to answer an early failure with a status)."""
    finished, last_time = False, None
    states = {i: _ChoiceStream(LogprobsWriter(job.tokenizer, job.kind, as_ids=job.tokens_as_ids),
                               started=job.delivered > 0) for i in range(job.n)}
    try:
        async for out in _outputs(loop_, job, first):
            last_time = observe(loop_, out, last_time)
            c = out.outputs[0]
            if out.prompt_logprobs is not None and c.index == 0:
                job.prompt_lps = out.prompt_logprobs
            if c.finish_reason == "error":
                finished = out.finished
                yield sse(error_body(500, out.error or "request failed in the engine", "internal_error"))
                break
            chunk = _chunk(job, states[c.index], out)
            if chunk is not None:
                yield sse(chunk)
            if out.finished:
                finished = True
                if job.include_usage:
                    n_tokens = sum(s.num_tokens for s in states.values())
                    yield sse(body(job.kind, job.response_id, job.model, [], chunk=True, usage=job.usage(n_tokens)))
        if not finished:
            yield sse(error_body(500, loop_.dead or "engine stopped", "internal_error"))
        yield sse("[DONE]")
    finally:
        if not finished:  # client disconnected (generator closed) or the engine stopped
            loop_.abort(job.engine_id)
