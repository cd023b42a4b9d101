"""What each hop of a P/D request sends, and the client's first chunk made from the prefill's answer (pure; no
I/O). The prefill hop computes the prompt and one token and keeps the KV (Handoff.prefill_request); the decode
hop carries the prefill's hand-off, or none when it decodes alone."""
from __future__ import annotations

from typing import Any

from disagg.worker.kv_transfer.handoff import Handoff
from disagg.worker.server.protocol import sse
from disagg.worker.server.responses import body as body_of, delta_choice

GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")  # the OpenAI routes that run the hops

HANDOFF_FIELD = "kv_transfer_params"  # the request's field that carries the hand-off
# a prefill worker's call to free a hand-off's KV that no decode will read (body: {HANDOFF_FIELD: hand-off})
RELEASE_PATH = "/v1/kv/release"


def check_max_tokens(body: dict[str, Any]) -> str | None:
    """The prefill hop overrides max_tokens, so a bad value must be caught before it (else the prefill's KV
    waits for a decode request that the decode worker rejects)."""
    for name in ("max_tokens", "max_completion_tokens"):
        value = body.get(name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            return f"{name} must be an integer >= 1, got {value!r}"
    return None


def needs_prompt_logits(body: dict[str, Any]) -> bool:
    """Prompt logprobs (vLLM's prompt_logprobs, or echo with logprobs) need the logits of every prompt position,
    which only the worker that computes the prompt has: such a request goes to a decode worker alone."""
    return body.get("prompt_logprobs") is not None or bool(body.get("echo") and body.get("logprobs") is not None)


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The first hop: compute the prompt, produce one token, keep the KV for the decode worker."""
    # n choices fork on the decode worker from one prefill; logprobs are the decode's to compute
    p = dict(body, max_tokens=1, stream=False, **{HANDOFF_FIELD: Handoff.prefill_request().to_wire()})
    if "n" in p:
        p["n"] = 1
    for name in ("stream_options", "logprobs", "top_logprobs", "echo"):
        p.pop(name, None)
    # the prefill's token may be the one the client gets first (early_first_chunk): it must obey min_tokens too
    if isinstance(p.get("min_tokens"), int) and p["min_tokens"] > 0:
        p["min_tokens"] = 1
    else:
        p.pop("min_tokens", None)
    if "max_completion_tokens" in p:
        p["max_completion_tokens"] = 1
    return p


def decode_bodies(body: dict[str, Any], handoff: Handoff | None,
                  delivered: tuple[int, ...] | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """(what the decode hop sends, what it sends to decode alone - the prompt computed there, when no decode
    endpoint of the prefill's revision is left); the same object twice when there is no hand-off.
    delivered: the tokens the client has already (the early first token); both bodies continue after them."""
    bare = {k: v for k, v in body.items() if k != HANDOFF_FIELD}
    if delivered is not None:
        return ({**bare, HANDOFF_FIELD: handoff.delivering(delivered).to_wire()},
                {**bare, HANDOFF_FIELD: Handoff.delivered_only(delivered).to_wire()})
    if handoff is None:
        return bare, bare
    return {**bare, HANDOFF_FIELD: handoff.to_wire()}, bare


def early_first_chunk(body: dict[str, Any], path: str, answer: Any, kv_params: Handoff | None) -> bytes | None:
    """The client's first SSE chunk, made from the prefill's answer, for a streamed request the decode worker
    can continue after it (kv_transfer_params.output_token_ids: an engine that supports
    delivered_token_ids); None when the decode worker must stream from the first token itself.

    The prefill sampled that token already (max_tokens=1) and its KV is what the decode worker reads, so
    sending it at once takes the decode hop, the KV transfer and the decode's admission out of the time to
    first token. Not for what the one-token answer does not carry as the full request would: logprobs, echo,
    n > 1, and stop strings (a streamed text held back as a possible stop string's start)."""
    if not body.get("stream") or kv_params is None or not isinstance(answer, dict):
        return None
    if len(kv_params.output_token_ids) != 1:
        return None
    if body.get("n") not in (None, 1) or body.get("best_of") not in (None, 1) or body.get("echo") \
            or body.get("logprobs") not in (None, False) or body.get("top_logprobs") is not None \
            or body.get("stop") not in (None, "", []):
        return None
    options = body.get("stream_options")
    if isinstance(options, dict) and options.get("continuous_usage_stats"):
        return None
    chat = path.endswith("/chat/completions")
    try:
        (c,) = answer["choices"]
        text = c["message"]["content"] if chat else c["text"]
        if not isinstance(text, str) or text.endswith("\ufffd"):
            # U+FFFD: the token is part of a character (byte-level tokens); a stream holds such text back until
            # the character is complete, so the decode worker must render it with the tokens that follow
            return None
        kind = "chat" if chat else "completion"
        # the worker's own chunk, with the prefill's id and creation time (the decode worker's chunks share them)
        chunk = body_of(kind, answer["id"], answer["model"], [delta_choice(kind, 0, text, None, None, first=True)],
                        chunk=True, created=answer["created"])
    except (KeyError, TypeError, ValueError):
        return None
    return sse(chunk)
