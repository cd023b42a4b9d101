"""Admission at the worker: what a request must pass before the engine queues it, and the work done for it off the
event loop and off the engine thread.

- The waiting queue is bounded, by requests (beyond the running slots the next step fills) and by the prompt tokens
  the queued requests will compute here: past either the request is answered 429 with Retry-After, counted in
  `disagg:requests_rejected_total{reason}`. Checked twice with the same rule (`refusal`): on the event loop against
  the engine's last reading plus the requests being prepared (a flood is turned away before anything is parsed or
  tokenized), and in the engine thread as the request is added (the one place that sees the queue as it is).
- The prompt's length is checked before tokenization where that is safe: token ids by their count, text by a lower
  bound on its token count (model/tokenizer.Tokenizer.min_num_tokens), so no prompt that fits is refused.
- Parsing, the chat template, tokenization and grammar compilation run on a small thread pool (`Preparer`): the
  event loop keeps answering (health, streams) and the engine thread only queues and steps.
"""
from __future__ import annotations

import asyncio
import math
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal

from disagg.worker.engine.stats import QueueLoad
from disagg.worker.sampling_params import SamplingParams
from disagg.worker.server.protocol import APIError, ChatCompletionRequest, CompletionRequest, parse_request

RETRY_AFTER_S = 1  # what a refused client is told to wait: about a few engine steps' worth of the queue draining
# the defaults: the queue may hold one more batch of requests, and eight steps' worth of prompt tokens to compute;
# a decode worker's queue an eighth of a batch: what waits there is a hand-off whose client has its first token
# already (the early first token) and whose KV a prefill worker holds meanwhile - a stream stalled, not a request
# that has not started. The router keeps the rest at its door, before any prefill (router/capacity.py), where a
# request that cannot get room soon is told 429 at once; a long queue here let it admit what then missed its SLO
# (bench/overload.py: at 10x capacity, a full decode queue of 64 held admitted requests' TTFT at seconds).
WAITING_REQUESTS_PER_SEQ = 1
DECODE_WAITING_REQUESTS_PER_SEQ = 1 / 8
WAITING_PROMPT_TOKENS_PER_BATCH = 8
PREP_THREADS = 4

Kind = Literal["completion", "chat"]
Reason = Literal["waiting_requests", "waiting_prompt_tokens"]


@dataclass(frozen=True)
class AdmissionLimits:
    max_waiting_requests: int  # requests queued beyond the free running slots
    max_waiting_prompt_tokens: int  # prompt tokens queued to compute here (a request alone is always queued)

    @staticmethod
    def of(max_num_seqs: int, max_num_batched_tokens: int, max_waiting_requests: int | None = None,
           max_waiting_prompt_tokens: int | None = None, role: str = "both") -> AdmissionLimits:
        """The flags' values, or the defaults derived from the engine's batch limits (and the worker's role)."""
        per_seq = DECODE_WAITING_REQUESTS_PER_SEQ if role == "decode" else WAITING_REQUESTS_PER_SEQ
        requests = max(math.ceil(max_num_seqs * per_seq), 1) if max_waiting_requests is None else max_waiting_requests
        tokens = max_num_batched_tokens * WAITING_PROMPT_TOKENS_PER_BATCH if max_waiting_prompt_tokens is None \
            else max_waiting_prompt_tokens
        return AdmissionLimits(requests, tokens)


def refusal(limits: AdmissionLimits, load: QueueLoad, requests: int, prompt_tokens: int) -> Reason | None:
    """Why `requests` engine requests (n choices) with `prompt_tokens` to compute here may not join the queue
    now, or None when they may."""
    if load.waiting + requests - load.free_slots > limits.max_waiting_requests:
        return "waiting_requests"
    if load.waiting_prompt_tokens and load.waiting_prompt_tokens + prompt_tokens > limits.max_waiting_prompt_tokens:
        return "waiting_prompt_tokens"
    return None


REFUSED_WORDS = {"waiting_requests": "{} requests are queued (at most {} beyond the running batch)",
                 "waiting_prompt_tokens": "{} prompt tokens are queued (at most {})"}


class QueueFull(Exception):
    """The waiting queue is full (`reason`); answered 429 with Retry-After."""

    def __init__(self, reason: Reason, load: QueueLoad, limits: AdmissionLimits):
        queued, limit = ((load.waiting, limits.max_waiting_requests) if reason == "waiting_requests"
                         else (load.waiting_prompt_tokens, limits.max_waiting_prompt_tokens))
        super().__init__(f"the server is at capacity: {REFUSED_WORDS[reason].format(queued, limit)}; retry later")
        self.reason = reason

    def api_error(self) -> APIError:
        return APIError(429, str(self), "rate_limit_exceeded", retry_after_s=RETRY_AFTER_S)


class PromptTooLong(APIError):
    """A 400: the prompt cannot fit max_model_len, told before tokenizing it."""


@dataclass
class Prepared:
    """A request ready for the engine: parsed, its prompt as token ids, its sampling settings (grammar compiled)."""
    request: CompletionRequest | ChatCompletionRequest
    prompt_ids: list[int]
    sampling_params: SamplingParams


class Preparer:
    """The work before the engine, on a few threads of its own (the tokenizer releases the GIL; templates and
    grammars at least leave the event loop and the engine thread alone)."""

    def __init__(self, threads: int = min(PREP_THREADS, os.cpu_count() or 1)):
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="prepare")

    async def prepare(self, engine: Any, raw: bytes, kind: Kind) -> Prepared:
        return await asyncio.get_running_loop().run_in_executor(self._pool, prepare, engine, raw, kind)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def prepare(engine: Any, raw: bytes, kind: Kind) -> Prepared:
    """Parse, check the prompt's length (before tokenizing where it can), tokenize, build the sampling settings and
    compile their grammar; every problem is an APIError naming it."""
    req = parse_request(raw, engine.served_model_name, ChatCompletionRequest if kind == "chat" else CompletionRequest)
    check_prompt_bound(engine, req)
    prompt_ids = prompt_token_ids(engine, req)
    sp = req.sampling_params(len(prompt_ids), engine.max_model_len)
    try:
        engine.compile_structured_output(sp)
    except ValueError as e:
        raise APIError(400, str(e)) from None
    return Prepared(req, prompt_ids, sp)


def check_prompt_bound(engine: Any, req: CompletionRequest | ChatCompletionRequest) -> None:
    """A prompt that cannot fit, told before tokenizing it: token ids by their count, text by the fewest tokens
    it can encode to."""
    limit = engine.max_model_len
    if isinstance(req, ChatCompletionRequest):
        at_least = sum(engine.tokenizer.min_num_tokens(m.text()) for m in req.messages)
    else:
        prompt = req.single_prompt()
        at_least = engine.tokenizer.min_num_tokens(prompt) if isinstance(prompt, str) else len(prompt)
    if at_least >= limit:
        raise PromptTooLong(400, f"prompt has at least {at_least} tokens; max_model_len is {limit} (prompt plus at "
                       "least one new token must fit)", param="messages" if isinstance(req, ChatCompletionRequest)
                       else "prompt")


def prompt_token_ids(engine: Any, req: CompletionRequest | ChatCompletionRequest) -> list[int]:
    tok = engine.tokenizer
    if isinstance(req, ChatCompletionRequest):
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        try:
            text = tok.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt)
        except Exception as e:  # noqa: BLE001 - a template error is the request's fault (e.g. bad roles)
            raise APIError(400, f"messages: cannot apply the chat template: {e}", param="messages") from None
        return tok.encode(text, add_special_tokens=False)
    prompt = req.single_prompt()
    if isinstance(prompt, str):
        return tok.encode(prompt)
    return list(prompt)  # the engine checks the ids against the vocabulary
