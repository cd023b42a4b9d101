"""vLLM's /tokenize, /detokenize and /version, on the worker's tokenizer and chat template."""
from __future__ import annotations

import importlib.metadata
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from disagg.worker.server.protocol import APIError, ChatMessage, parse_request


class TokenizeCompletion(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    return_token_strs: bool = False


class Detokenize(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[int]


def version() -> str:
    try:
        return importlib.metadata.version("disagg")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


async def _parse(request: Request, engine: Any, *models: type[BaseModel]) -> Any:
    return parse_request(await request.body(), engine.served_model_name, *models)


def _tokenize(engine: Any, req: TokenizeCompletion | TokenizeChat) -> dict[str, Any]:
    tok = engine.tokenizer
    if isinstance(req, TokenizeChat):
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        try:
            text = tok.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt)
        except Exception as e:  # noqa: BLE001 - a template error is the request's fault
            raise APIError(400, f"messages: cannot apply the chat template: {e}", param="messages") from None
    else:
        text = req.prompt
    ids = tok.encode(text, add_special_tokens=req.add_special_tokens)
    strs = [tok.hf_tokenizer.id_to_token(i) for i in ids] if req.return_token_strs else None
    return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids, "token_strs": strs}


def add_tokenize_routes(app: FastAPI, loop_: Any) -> None:
    def engine() -> Any:
        if not loop_.ready:
            raise APIError(503, loop_.dead or "model is loading", "service_unavailable")
        return loop_.engine

    @app.get("/version")
    async def get_version() -> Response:
        return JSONResponse({"version": version()})

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        try:
            e = engine()
            return JSONResponse(_tokenize(e, await _parse(request, e, TokenizeCompletion, TokenizeChat)))
        except APIError as err:
            return JSONResponse(err.body(), status_code=err.status)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        try:
            e = engine()
            req = await _parse(request, e, Detokenize)
            vocab = e.model_config.vocab_size
            bad = [t for t in req.tokens if not 0 <= t < vocab]
            if bad:
                raise APIError(400, f"tokens: ids {bad[:5]} are outside the vocabulary [0, {vocab})", param="tokens")
            return JSONResponse({"prompt": e.tokenizer.decode(req.tokens)})
        except APIError as err:
            return JSONResponse(err.body(), status_code=err.status)
