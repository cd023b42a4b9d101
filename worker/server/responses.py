"""OpenAI response bodies: choices (n of them), logprobs in the completions and chat shapes, stream chunks."""
from __future__ import annotations

import time
from typing import Any, Literal

from disagg.worker.outputs import TokenLogprobs

Kind = Literal["completion", "chat"]
MIN_LOGPROB = -9999.0  # JSON has no -inf (vLLM clamps the same way)


def _lp(value: float) -> float:
    return max(value, MIN_LOGPROB)


def _byte_decoder() -> dict[str, int]:
    """The inverse of GPT-2's byte-to-printable-character map, which byte-level BPE vocabularies use."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_DECODER = _byte_decoder()


class LogprobsWriter:
    """One choice's logprobs, written incrementally (streaming) or at once; keeps the text offset running.
    as_ids: vLLM's return_tokens_as_token_ids ("token_id:N"), for tokens that are not whole characters."""

    def __init__(self, tokenizer: Any, kind: Kind, offset: int = 0, as_ids: bool = False):
        self._tokenizer, self.kind, self.offset, self.as_ids = tokenizer, kind, offset, as_ids

    def token_text(self, token_id: int) -> str:
        if self.as_ids:
            return f"token_id:{token_id}"
        return self._tokenizer.decode([token_id], skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> list[int]:
        """The token's own bytes (a byte-level token may be part of a UTF-8 character, which decodes to U+FFFD)."""
        text = self._tokenizer.decode([token_id], skip_special_tokens=False)
        if "\ufffd" in text:
            piece = self._tokenizer.hf_tokenizer.id_to_token(token_id) or ""
            if all(ch in _BYTE_DECODER for ch in piece):
                return [_BYTE_DECODER[ch] for ch in piece]
        return list(text.encode())

    def completion(self, entries: list[tuple[int, TokenLogprobs | None]]) -> dict[str, Any]:
        """entries: (token id, its logprobs or None - the first prompt token has none)."""
        tokens, lps, tops, offsets = [], [], [], []
        for token_id, e in entries:
            text = self.token_text(token_id)
            tokens.append(text)
            offsets.append(self.offset)
            self.offset += len(text)
            if e is None:
                lps.append(None)
                tops.append(None)
                continue
            lps.append(_lp(e.logprob))
            top: dict[str, float] = {}
            for t, v in e.top:  # best first: where two tokens print alike, the likelier one stays
                top.setdefault(self.token_text(t), _lp(v))
            top.setdefault(text, _lp(e.logprob))  # the sampled token is always listed, as vLLM does
            tops.append(top)
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}

    def chat(self, entries: list[TokenLogprobs]) -> dict[str, Any]:
        def one(token_id: int, logprob: float) -> dict[str, Any]:
            return {"token": self.token_text(token_id), "logprob": _lp(logprob), "bytes": self.token_bytes(token_id)}

        return {"content": [{**one(e.token_id, e.logprob), "top_logprobs": [one(t, v) for t, v in e.top]}
                            for e in entries]}


def prompt_logprobs_json(tokenizer: Any, prompt_ids: list[int], entries: list[TokenLogprobs | None] | None) -> Any:
    """vLLM's `prompt_logprobs`: per prompt token, None or {token id: {logprob, rank, decoded_token}}."""
    if entries is None:
        return None
    out: list[Any] = []
    for token_id, e in zip(prompt_ids, entries):
        if e is None:
            out.append(None)
            continue
        d = {str(t): {"logprob": _lp(v), "rank": r + 1, "decoded_token": tokenizer.decode([t], False)}
             for r, (t, v) in enumerate(e.top)}
        d.setdefault(str(token_id), {"logprob": _lp(e.logprob), "rank": e.rank,
                                     "decoded_token": tokenizer.decode([token_id], False)})
        out.append(d)
    return out


def choice(kind: Kind, index: int, text: str, logprobs: Any, finish_reason: str | None,
           stop_reason: int | str | None = None) -> dict[str, Any]:
    if kind == "chat":
        return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                "finish_reason": finish_reason, "stop_reason": stop_reason}
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason,
            "stop_reason": stop_reason}


def delta_choice(kind: Kind, index: int, text: str | None, logprobs: Any, finish_reason: str | None,
                 first: bool = False) -> dict[str, Any]:
    if kind == "chat":
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if text is not None:
            delta["content"] = text
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    return {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}


def body(kind: Kind, req_id: str, model: str, choices: list[dict[str, Any]], chunk: bool = False,
         **extra: Any) -> dict[str, Any]:
    obj = ("chat.completion.chunk" if chunk else "chat.completion") if kind == "chat" else "text_completion"
    return {"id": req_id, "object": obj, "created": int(time.time()), "model": model, "choices": choices, **extra}
