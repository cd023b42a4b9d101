"""OpenAI-compatible request schemas, response builders and error bodies (the external HTTP contract)."""
from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from disagg.worker.sampling_params import MAX_LOGPROBS, SamplingParams
from disagg.worker.server.structured_fields import StructuredFields
from disagg.worker.kv_transfer.connectors import handoff_fields_of
from disagg.worker.kv_transfer.handoff import Handoff, HandoffError


MAX_N = 16  # choices per request at most


class APIError(Exception):
    """An OpenAI-style error: {"error": {"message", "type", "param", "code"}} with an HTTP status."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 retry_after_s: int | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param
        self.retry_after_s = retry_after_s  # a Retry-After header (429, 503), when set

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
    msg = "this field is not supported" if e["type"] == "extra_forbidden" else e["msg"]
    return f"{param}: {msg}" if param else msg, param


def parse_request(raw: bytes, served_model_name: str, model_cls: type[BaseModel],
                  chat_cls: type[BaseModel] | None = None) -> Any:
    """A request body -> its pydantic model (`chat_cls` when the body has `messages`); every problem is an APIError
    naming it: malformed JSON, not an object, a field (400), another model's name (404)."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"malformed JSON body: {e}") from None
    if not isinstance(body, dict):
        raise APIError(400, f"request body must be a JSON object, got {type(body).__name__}")
    cls = chat_cls if chat_cls is not None and "messages" in body else model_cls
    try:
        req = cls.model_validate(body)
    except ValidationError as e:
        message, param = validation_message(e)
        raise APIError(400, message, param=param) from None
    if getattr(req, "model", None) is not None and req.model != served_model_name:
        raise APIError(404, f"The model `{req.model}` does not exist.", "NotFoundError", "model")
    return req


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _SamplingFields(StructuredFields):
    # an unknown or unsupported field is a 400 naming it, never silently ignored (see the README's table)
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    max_tokens: int | None = None  # None: up to the context length
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[str, float] | None = None
    prompt_logprobs: int | None = None  # vLLM's extra field
    return_tokens_as_token_ids: bool = False  # vLLM's: logprobs name tokens "token_id:N"
    user: str | None = None  # accepted; this server keeps no per-user state
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    kv_transfer_params: dict[str, Any] | None = None  # P/D hand-off, as in vLLM's NIXL flow

    def num_logprobs(self) -> int | None:
        raise NotImplementedError

    def sampling_params(self, num_prompt_tokens: int, max_model_len: int) -> SamplingParams:
        max_tokens = self.max_tokens if self.max_tokens is not None else max(max_model_len - num_prompt_tokens, 1)
        try:
            bias = {int(k): v for k, v in (self.logit_bias or {}).items()}
        except ValueError:
            raise APIError(400, "logit_bias: keys must be token ids", param="logit_bias") from None
        try:
            structured = self.structured_spec()
        except ValueError as e:
            param, message = e.args
            raise APIError(400, message, param=param) from None
        try:
            return SamplingParams(
                max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                min_p=self.min_p, seed=self.seed, stop=self.stop or [], stop_token_ids=self.stop_token_ids or [],
                include_stop_str_in_output=self.include_stop_str_in_output, ignore_eos=self.ignore_eos,
                min_tokens=self.min_tokens, n=self.n, presence_penalty=self.presence_penalty,
                frequency_penalty=self.frequency_penalty, repetition_penalty=self.repetition_penalty,
                logit_bias=bias, logprobs=self.num_logprobs(), prompt_logprobs=self.prompt_logprobs,
                skip_special_tokens=self.skip_special_tokens, structured_output=structured,
            )
        except ValueError as e:
            raise APIError(400, str(e), param=str(e).split(" ", 1)[0]) from None


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    def num_logprobs(self) -> int | None:
        return self.logprobs

    def model_post_init(self, _: Any) -> None:
        if self.echo and self.logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = self.logprobs  # echo + logprobs: the prompt's too (lm-eval's loglikelihood)

    def single_prompt(self) -> str | list[int]:
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise APIError(400, f"prompt: batches are not supported, got {len(p)} prompts; send one per "
                               "request", param="prompt")
            return p[0]
        return p


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]  # images, audio, files: a 400, not silently dropped
    text: str


# assistant-message fields a client echoes back from an earlier response; empty, they say nothing
_EMPTY_OK = ("refusal", "annotations", "audio", "function_call", "tool_calls", "reasoning_content")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")  # tool_calls etc. with content: a 400 naming the field
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _drop_empty_echoed_fields(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if not (k in _EMPTY_OK and v in (None, [], ""))}
        return data

    def text(self) -> str:
        if isinstance(self.content, list):  # [{"type": "text", "text": ...}]
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    add_generation_prompt: bool = True
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    def num_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs: needs logprobs=true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    def model_post_init(self, _: Any) -> None:
        if self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens


def check_kv_transfer_params(params: Any, connector: str | None) -> Handoff | None:
    """The request's P/D hand-off, parsed (handoff.py) with the keys the worker's connector declares
    (kv_transfer/connectors.py); what it could not act on is an APIError 400 naming the field."""
    if params is None:
        return None
    if not connector:
        raise APIError(400, "kv_transfer_params: this worker has no KV connector (--kv-connector)",
                       param="kv_transfer_params")
    try:
        return Handoff.parse(params, handoff_fields_of(connector))
    except HandoffError as e:
        raise APIError(400, str(e), param=e.param) from None


def check_signature(signer: Any, handoff: Handoff) -> None:
    """A hand-off naming remote KV must be signed by a prefill worker of this resource, unexpired and unused
    (handoff_auth.py): else a 403 (400: no lease end) naming what is wrong, and nothing is contacted."""
    from disagg.worker.kv_transfer.handoff_auth import HandoffRejected

    try:
        signer.verify(handoff)
    except HandoffRejected as e:
        raise APIError(e.status, str(e), "permission_denied" if e.status == 403 else "invalid_request_error",
                       e.param) from None


# ---------------------------------------------------------------- responses
def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
