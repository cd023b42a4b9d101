"""The router's in-flight bound answered at the HTTP parser (parser_door.py), over a real loopback socket: the
refused request never reaches the ASGI app, its 429 is the door's (Retry-After, X-Request-Id, the JSON error
naming the bound), its body is dropped and the connection serves the client's next request - pipelined or not;
Connection: close is honoured; with API keys a request without one is still answered 401 by the app; over TLS
the same."""
from __future__ import annotations

import asyncio
import json
import socket

import httpx
import pytest
import uvicorn
from scripted_router import scripted_router

from disagg.worker.api_keys import ApiKeys, RequireApiKey
from disagg.worker.listener import BatchAcceptServer
from disagg.worker.local.self_signed import client_context, write_self_signed
from disagg.worker.router.app import build_app
from disagg.worker.router.parser_door import refusing_protocol

D1, D2 = "http://d1:1", "http://d2:1"
BODY = json.dumps({"prompt": "x", "max_tokens": 4}).encode()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Seen:
    """ASGI: the paths the app was asked for (outside everything else)."""

    def __init__(self, app):
        self.app, self.paths = app, []

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            self.paths.append(scope["path"])
        await self.app(scope, receive, send)


def _post(path: str = "/v1/completions", body: bytes = BODY, extra: str = "") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nhost: r\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            f"{extra}\r\n").encode() + body


async def _responses(reader: asyncio.StreamReader, n: int) -> list[tuple[int, dict[str, str], bytes]]:
    """n whole HTTP/1.1 responses (content-length bodies) read off one connection."""
    out = []
    for _ in range(n):
        head = (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)).decode("latin-1").split("\r\n")
        headers = dict(line.lower().split(": ", 1) for line in head[1:] if line)
        body = await asyncio.wait_for(reader.readexactly(int(headers["content-length"])), 5)
        out.append((int(head[0].split()[1]), headers, body))
    return out


async def _scenario(keys: ApiKeys | None, tls: tuple[str, str] | None) -> None:
    gate, arrived = asyncio.Event(), []

    async def workers(request: httpx.Request) -> httpx.Response:
        arrived.append(request.url.host)
        await gate.wait()
        return httpx.Response(200, json={"choices": [{"text": "decoded"}]})

    _, state = scripted_router([], [D1, D2], workers, max_in_flight_per_endpoint=1)  # bound: 2
    app = build_app(state)
    if keys is not None:
        app.add_middleware(RequireApiKey, keys=keys)
    seen = Seen(app)
    protocol = refusing_protocol(state, keys)
    assert protocol is not None, "uvicorn's httptools protocol is missing: the router would answer every 429 in ASGI"
    port = _free_port()
    ssl = {"ssl_certfile": tls[0], "ssl_keyfile": tls[1]} if tls else {}
    verify = client_context(tls[0]) if tls else None
    server = BatchAcceptServer(uvicorn.Config(seen, host="127.0.0.1", port=port, lifespan="off", log_level="warning",
                                              http=protocol, **ssl))
    task = asyncio.ensure_future(server.serve())
    auth = {"Authorization": "Bearer k1"} if keys is not None else {}
    try:
        while not server.started:
            assert not task.done(), "the server did not start"
            await asyncio.sleep(0.02)
        url = f"{'https' if tls else 'http'}://127.0.0.1:{port}"
        async with httpx.AsyncClient(base_url=url, headers=auth, timeout=10, verify=verify or True) as client:
            held = [asyncio.ensure_future(client.post("/v1/completions", content=BODY)) for _ in range(2)]
            while len(arrived) < 2:
                await asyncio.sleep(0.01)
            seen.paths.clear()
            reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=verify)
            key = "authorization: Bearer k1\r\n" if keys is not None else ""
            # a refused request whose body comes in two parts, a second one pipelined right behind it, then /health
            big = json.dumps({"prompt": "y" * 50_000, "max_tokens": 4}).encode()
            first = _post(body=big, extra=f"x-request-id: req-1\r\n{key}")
            writer.write(first[:200])
            await writer.drain()
            await asyncio.sleep(0.05)
            writer.write(first[200:] + _post(extra=key) + b"GET /health HTTP/1.1\r\nhost: r\r\n\r\n")
            await writer.drain()
            (s1, h1, b1), (s2, h2, _), (s3, _, b3) = await _responses(reader, 3)
            assert (s1, s2, s3) == (429, 429, 200)
            assert h1["retry-after"] == "1" and h1["x-request-id"] == "req-1" and h2["x-request-id"]
            assert h1["content-type"] == "application/json"
            error = json.loads(b1)["error"]
            assert "serves 2 requests, its bound (2)" in error["message"] and error["code"] == 429
            assert json.loads(b3)["status"] == "ok"
            assert seen.paths == ["/health"], "a refused request reached the ASGI app"
            assert state.metrics.registry.get_sample_value(
                "disagg:router_requests_total", {"model_name": "m", "role": "router", "outcome": "shed"}) == 2
            # Connection: close is answered and honoured
            writer.write(_post(extra=f"connection: close\r\n{key}"))
            await writer.drain()
            [(s4, h4, _)] = await _responses(reader, 1)
            assert s4 == 429 and h4["connection"] == "close"
            assert await asyncio.wait_for(reader.read(), 5) == b""
            writer.close()
            if keys is not None:  # no key: the app's 401, whatever the load
                r = await client.post("/v1/completions", content=BODY, headers={"Authorization": ""})
                assert r.status_code == 401
            gate.set()
            assert [r.status_code for r in await asyncio.gather(*held)] == [200, 200]
            r = await client.post("/v1/completions", content=BODY)  # under the bound again: served
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == "decoded"
            assert state.in_flight == 0 and len(arrived) == 3
    finally:
        gate.set()
        server.should_exit = True
        await asyncio.wait_for(task, 10)


@pytest.mark.parametrize("keys,tls", [(None, False), (ApiKeys.of(["k1"]), False), (None, True)],
                         ids=["open", "api-keys", "tls"])
def test_past_the_bound_the_parser_answers_429_and_the_connection_serves_on(keys, tls, tmp_path):
    files = tuple(map(str, write_self_signed(tmp_path / "tls", ["127.0.0.1"]))) if tls else None
    asyncio.run(_scenario(keys, files))
