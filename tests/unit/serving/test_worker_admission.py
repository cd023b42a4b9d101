"""Admission at the worker (pure parts and in-process adapters): the waiting queue's bounds, the prompt's length
told before tokenizing (a lower bound that never refuses a prompt that fits), the request body's limit (413 before
reading where Content-Length says so, while reading otherwise; 408 on a stalled body), and the event loop's early
refusal from the engine's last reading."""
from __future__ import annotations

import argparse
import asyncio
import json
import random

import pytest

from disagg.worker.body_limit import LimitRequestBody, add_body_arguments, body_limit_problems
from disagg.worker.engine.stats import QueueLoad
from disagg.worker.model.tokenizer import Tokenizer, length_bound
from disagg.worker.server.admission import (
    AdmissionLimits, PromptTooLong, QueueFull, check_prompt_bound, prepare, refusal,
)
from disagg.worker.server.engine_loop import EngineLoop
from disagg.worker.server.protocol import ChatCompletionRequest, CompletionRequest

LIMITS = AdmissionLimits(max_waiting_requests=4, max_waiting_prompt_tokens=100)


@pytest.mark.parametrize("load, requests, tokens, want", [
    (QueueLoad(waiting=0, waiting_prompt_tokens=0, free_slots=8), 1, 10, None),
    # the running batch's free slots take waiting requests at the next step: only what is beyond counts
    (QueueLoad(waiting=11, waiting_prompt_tokens=50, free_slots=8), 1, 10, None),
    (QueueLoad(waiting=12, waiting_prompt_tokens=50, free_slots=8), 1, 10, "waiting_requests"),
    (QueueLoad(waiting=4, waiting_prompt_tokens=0, free_slots=0), 1, 0, "waiting_requests"),
    (QueueLoad(waiting=2, waiting_prompt_tokens=0, free_slots=0), 3, 0, "waiting_requests"),  # n = 3 choices
    (QueueLoad(waiting=1, waiting_prompt_tokens=90, free_slots=0), 1, 10, None),
    (QueueLoad(waiting=1, waiting_prompt_tokens=90, free_slots=0), 1, 11, "waiting_prompt_tokens"),
    # a request alone is always queued, however long its prompt (max_model_len bounds it)
    (QueueLoad(waiting=0, waiting_prompt_tokens=0, free_slots=0), 1, 5000, None),
])
def test_the_waiting_queue_is_bounded_by_requests_beyond_the_free_slots_and_by_prompt_tokens(load, requests,
                                                                                              tokens, want):
    assert refusal(LIMITS, load, requests, tokens) == want


def test_default_limits_follow_the_batch_limits():
    assert AdmissionLimits.of(64, 2048) == AdmissionLimits(64, 8 * 2048)
    # a decode worker queues few hand-offs beyond its batch: each is a started stream, stalled
    assert AdmissionLimits.of(64, 2048, role="decode") == AdmissionLimits(8, 8 * 2048)
    assert AdmissionLimits.of(4, 2048, role="decode").max_waiting_requests == 1
    assert AdmissionLimits.of(64, 2048, 20, role="decode").max_waiting_requests == 20
    assert AdmissionLimits.of(64, 2048, 0, 500) == AdmissionLimits(0, 500)


def test_a_full_queue_says_what_is_queued_and_asks_to_retry_later():
    e = QueueFull("waiting_requests", QueueLoad(70, 0, 0), AdmissionLimits(64, 100)).api_error()
    assert (e.status, e.type, e.retry_after_s) == (429, "rate_limit_exceeded", 1)
    assert "70 requests are queued (at most 64" in e.message


# ---------------------------------------------------------------- the prompt's length before tokenizing
def test_the_lower_bound_never_exceeds_the_token_count(tiny_model_dir):
    tok = Tokenizer(tiny_model_dir)
    rng = random.Random(0)
    alphabet = list("abc xyz\n\t") + ["é", "😀", "ß", "<s>", "</s>", "<|user|>", "  "]
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 200)))
        assert tok.min_num_tokens(text) <= len(tok.encode(text, add_special_tokens=False)), repr(text)


def doc(normalizer=None, pre_tokenizer=None, model=None, added=()):
    return {"normalizer": normalizer, "pre_tokenizer": pre_tokenizer, "model": model or {"type": "BPE"},
            "added_tokens": [{"content": c, "lstrip": lstrip, "rstrip": False} for c, lstrip in added]}


@pytest.mark.parametrize("tokenizer_json, want", [
    (doc(pre_tokenizer={"type": "ByteLevel"}), (3, 1, False)),
    (doc(normalizer={"type": "NFKC"}), (3, 4, False)),  # NFKC may turn a 4-byte letter into 1 byte
    (doc(normalizer={"type": "Sequence", "normalizers": [
        {"type": "Prepend", "prepend": "\u2581"}, {"type": "Replace", "pattern": {"String": " "},
                                                   "content": "\u2581"}]}), (3, 1, False)),
    (doc(added=[("<mask>", True)]), (6, 1, True)),  # an added token eats the whitespace around it
    (doc(normalizer={"type": "Strip"}), None),
    (doc(normalizer={"type": "Replace", "pattern": {"Regex": "\\s+"}, "content": " "}), None),
    (doc(pre_tokenizer={"type": "Whitespace"}), None),
    (doc(pre_tokenizer={"type": "Split", "behavior": "Removed"}), None),
    (doc(model={"type": "BPE", "fuse_unk": True}), None),
    (doc(model={"type": "WordPiece"}), None),
    (doc(model={"type": "Unigram", "byte_fallback": True}), (3, 1, False)),
])
def test_the_bound_is_given_only_where_no_character_run_can_vanish(tokenizer_json, want):
    bound = length_bound(tokenizer_json, ["ab", "abc", ""])
    assert (None if bound is None else (bound.max_token_bytes, bound.shrink, bound.whitespace_may_vanish)) == want


class NoEncode:
    """A tokenizer whose every token is 4 bytes at most and which must not be asked to encode."""

    def min_num_tokens(self, text: str) -> int:
        return -(-len(text.encode()) // 4)

    def encode(self, *a, **kw):
        raise AssertionError("tokenized a prompt that was known to be too long")


class Engine:
    served_model_name, max_model_len, tokenizer = "m", 100, NoEncode()


@pytest.mark.parametrize("req", [
    CompletionRequest.model_validate({"prompt": "x" * 400}),
    CompletionRequest.model_validate({"prompt": list(range(100))}),
    ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "y" * 200}] * 2}),
])
def test_a_prompt_that_cannot_fit_is_refused_before_tokenizing(req):
    with pytest.raises(PromptTooLong) as e:
        check_prompt_bound(Engine(), req)
    assert e.value.status == 400 and "at least 100 tokens" in e.value.message and "max_model_len is 100" in \
        e.value.message


def test_prepare_refuses_it_too_and_parses_first():
    with pytest.raises(PromptTooLong):
        prepare(Engine(), json.dumps({"prompt": "z" * 1000}).encode(), "completion")
    check_prompt_bound(Engine(), CompletionRequest.model_validate({"prompt": "x" * 396}))  # 99 tokens: may fit


# ---------------------------------------------------------------- the event loop's early refusal
def test_the_event_loop_refuses_from_the_last_reading_and_counts_requests_being_prepared():
    loop = EngineLoop(lambda: None, lambda _: None, limits=AdmissionLimits(2, 100))
    loop.load = QueueLoad(waiting=1, waiting_prompt_tokens=0, free_slots=0)
    loop.reserve()  # 2 queued
    with pytest.raises(QueueFull) as e:
        loop.reserve()  # a third, while the second is being prepared
    assert e.value.reason == "waiting_requests"
    loop.release()
    loop.reserve()
    unbounded = EngineLoop(lambda: None, lambda _: None)
    unbounded.load = QueueLoad(10**6, 10**9, 0)
    unbounded.reserve()


# ---------------------------------------------------------------- the body limit
async def call(app, headers, chunks, stall_after: int | None = None):
    """(status, body, what the app received): an ASGI request whose body comes in `chunks` (the last one followed
    by a disconnect); with stall_after the client sends that many chunks and then nothing."""
    messages = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]
    if stall_after is not None:
        messages = messages[:stall_after]
    sent, received = [], []

    async def receive():
        if messages:
            return messages.pop(0)
        if stall_after is not None:
            await asyncio.sleep(3600)
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    async def inner(scope, receive, send):
        received.append(await receive())
        received.append(await receive())  # the disconnect that follows the body is passed on
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    rejected = []
    limited = LimitRequestBody(inner, max_bytes=10, idle_s=0.2, on_reject=rejected.append)
    await limited({"type": "http", "method": "POST", "headers": headers}, receive, send)
    status = sent[0]["status"] if sent else None
    return status, b"".join(m.get("body", b"") for m in sent[1:]), received, rejected


def test_a_body_over_the_limit_is_refused_before_reading_when_its_length_is_declared():
    status, body, received, rejected = asyncio.run(call(None, [(b"content-length", b"11")], [b"x" * 11]))
    assert status == 413 and json.loads(body)["error"]["code"] == 413 and received == []
    assert rejected == ["body_too_large"]


def test_a_chunked_body_over_the_limit_is_refused_while_reading():
    status, _, received, rejected = asyncio.run(call(None, [], [b"x" * 6, b"y" * 6]))
    assert status == 413 and received == [] and rejected == ["body_too_large"]


def test_a_stalled_body_is_answered_408_and_never_reaches_the_app():
    status, _, received, rejected = asyncio.run(call(None, [], [b"x" * 3, b"y" * 3], stall_after=1))
    assert status == 408 and received == [] and rejected == ["body_timeout"]


def test_a_body_within_the_limit_reaches_the_app_whole_and_then_the_disconnect():
    status, body, received, rejected = asyncio.run(call(None, [(b"content-length", b"10")], [b"x" * 4, b"y" * 6]))
    assert (status, body) == (200, b"ok") and rejected == []
    assert received == [{"type": "http.request", "body": b"xxxxyyyyyy", "more_body": False},
                        {"type": "http.disconnect"}]


def test_the_body_flags_are_checked_and_each_bad_one_named():
    p = argparse.ArgumentParser()
    add_body_arguments(p)
    assert body_limit_problems(p.parse_args([])) == []
    problems = body_limit_problems(p.parse_args(["--max-request-body-bytes", "0", "--request-body-timeout", "0"]))
    assert [q.split()[0] for q in problems] == ["--max-request-body-bytes", "--request-body-timeout"]
