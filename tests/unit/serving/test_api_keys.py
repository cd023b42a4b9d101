"""Client API keys: which header passes, where keys come from, and the 401 every route but the probes' gives."""
from __future__ import annotations

import asyncio

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse, StreamingResponse

from disagg.worker.api_keys import ApiKeys, RequireApiKey, client_keys, read_key_file, worker_key, worker_own_keys

KEYS = ApiKeys.of(["sk-alpha", "sk-beta"])


@pytest.mark.parametrize("header, problem", [
    ("Bearer sk-alpha", None),
    ("bearer   sk-beta ", None),  # the scheme is case-insensitive, whitespace around the key is not part of it
    ("Bearer sk-gamma", "invalid API key"),
    ("Bearer sk-alph", "invalid API key"),
    ("Basic c2stYWxwaGE=", "Authorization: Bearer"),
    ("sk-alpha", "Authorization: Bearer"),
    ("Bearer ", "Authorization: Bearer"),
    (None, "Authorization: Bearer"),
])
def test_only_a_bearer_token_equal_to_one_of_the_keys_passes(header, problem):
    got = KEYS.problem(header)
    assert got is None if problem is None else problem in got


def test_keys_come_from_a_file_one_a_line_and_the_environment(tmp_path):
    f = tmp_path / "keys"
    f.write_text("# tenants\nsk-one\n\n  sk-two  \n")
    assert read_key_file(str(f)) == ["sk-one", "sk-two"]
    keys = client_keys(str(f), {"DISAGG_API_KEY": "sk-three"})
    assert [keys.problem(f"Bearer {k}") for k in ("sk-one", "sk-two", "sk-three")] == [None] * 3
    assert client_keys(None, {}) is None
    assert "sk-one" not in repr(keys)
    (tmp_path / "empty").write_text("# none\n")
    with pytest.raises(ValueError, match="holds no key"):
        client_keys(str(tmp_path / "empty"), {})
    with pytest.raises(ValueError, match="API key file .*missing"):
        read_key_file(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="empty key"):
        ApiKeys.of([""])
    assert worker_key(str(f), {"DISAGG_WORKER_API_KEY": "w"}) == "sk-one"
    assert worker_key(None, {"DISAGG_WORKER_API_KEY": "w"}) == "w" and worker_key(None, {}) is None
    assert worker_own_keys(["a", "b"], {"VLLM_API_KEY": "v"}) == ["a", "b"]
    assert worker_own_keys(None, {"VLLM_API_KEY": "v"}) == ["v"] and worker_own_keys(None, {}) == []


def _app() -> FastAPI:
    app = FastAPI()

    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse({"status": "ok"})

    @app.post("/v1/completions")
    async def completions() -> StreamingResponse:
        return StreamingResponse(iter([b"data: 1\n\n", b"data: [DONE]\n\n"]), media_type="text/event-stream")

    app.add_middleware(RequireApiKey, keys=KEYS)
    return app


def test_every_route_but_the_probes_answers_401_without_a_key():
    async def run() -> None:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=_app()), base_url="http://t") as c:
            assert (await c.get("/health")).status_code == 200
            r = await c.post("/v1/completions")
            assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
            assert r.json()["error"]["code"] == 401 and "Authorization: Bearer" in r.json()["error"]["message"]
            r = await c.post("/v1/completions", headers={"Authorization": "Bearer nope"})
            assert r.status_code == 401 and r.json()["error"]["message"] == "invalid API key"
            assert (await c.get("/anything")).status_code == 401  # unknown routes too: no probing for them
            r = await c.post("/v1/completions", headers={"Authorization": "Bearer sk-beta"})
            assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")

    asyncio.run(run())
