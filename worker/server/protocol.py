"""OpenAI-compatible request schemas, response builders and error bodies (the external HTTP contract)."""
from __future__ import annotations

import json
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from disagg.worker.engine.sampling_params import SamplingParams
from disagg.worker.kv_transfer.connectors import params_check_of


class APIError(Exception):
    """An OpenAI-style error: {"error": {"message", "type", "param", "code"}} with an HTTP status."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.type, self.param)


def error_body(status: int, message: str, type_: str = "invalid_request_error", param: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": status}}


def sse(payload: dict[str, Any] | str) -> bytes:
    """One server-sent event: a JSON payload or a literal such as "[DONE]"."""
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


def validation_message(err: ValidationError) -> tuple[str, str | None]:
    """(message, param) naming the first bad field."""
    e = err.errors()[0]
    param = ".".join(str(p) for p in e["loc"]) or None
    return f"{param}: {e['msg']}" if param else e["msg"], param


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingFields(BaseModel):
    model_config = ConfigDict(extra="ignore")  # OpenAI clients send fields we do not use (user, n=1, ...)

    model: str | None = None
    max_tokens: int | None = None  # None: up to the context length
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=1)  # one choice per request
    kv_transfer_params: dict[str, Any] | None = None  # P/D hand-off, as in vLLM's NIXL flow

    def sampling_params(self, num_prompt_tokens: int, max_model_len: int) -> SamplingParams:
        max_tokens = self.max_tokens if self.max_tokens is not None else max(max_model_len - num_prompt_tokens, 1)
        try:
            return SamplingParams(
                max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                seed=self.seed, stop=self.stop or [], stop_token_ids=self.stop_token_ids or [],
                ignore_eos=self.ignore_eos,
            )
        except ValueError as e:
            raise APIError(400, str(e), param=str(e).split(" ", 1)[0]) from None


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False

    def single_prompt(self) -> str | list[int]:
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise APIError(400, f"prompt: batches are not supported, got {len(p)} prompts; send one per "
                               "request", param="prompt")
            return p[0]
        return p


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):  # [{"type": "text", "text": ...}]
            return "".join(part.get("text", "") for part in self.content if part.get("type") == "text")
        return self.content or ""


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    add_generation_prompt: bool = True

    def model_post_init(self, _: Any) -> None:
        if self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens


def check_kv_transfer_params(params: Any, connector: str | None) -> None:
    """Reject what the worker's connector could not act on, naming the field (raises APIError 400), with the
    check the connector declares (kv_transfer/connectors.py)."""
    if params is None:
        return
    if not connector:
        raise APIError(400, "kv_transfer_params: this worker has no KV connector (--kv-connector)",
                       param="kv_transfer_params")
    check = params_check_of(connector)
    if check is None:  # an out-of-tree connector checks its own params in the engine
        return
    try:
        check(params)
    except ValueError as e:
        raise APIError(400, str(e), param=getattr(e, "param", None) or "kv_transfer_params") from None


# ---------------------------------------------------------------- responses
def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_response(kind: Literal["completion", "chat"], req_id: str, model: str, text: str,
                        finish_reason: str | None, usage_: dict[str, int],
                        kv_transfer_params: dict[str, Any] | None) -> dict[str, Any]:
    if kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": finish_reason}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        obj = "text_completion"
    return {"id": req_id, "object": obj, "created": int(time.time()), "model": model, "choices": [choice],
            "usage": usage_, "kv_transfer_params": kv_transfer_params}


def stream_chunk(kind: Literal["completion", "chat"], req_id: str, model: str, text: str | None,
                 finish_reason: str | None, first: bool = False) -> dict[str, Any]:
    if kind == "chat":
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if text is not None:
            delta["content"] = text
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        obj = "text_completion"
    return {"id": req_id, "object": obj, "created": int(time.time()), "model": model, "choices": [choice]}


def usage_chunk(kind: Literal["completion", "chat"], req_id: str, model: str, usage_: dict[str, int]) -> dict:
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    return {"id": req_id, "object": obj, "created": int(time.time()), "model": model, "choices": [],
            "usage": usage_}
