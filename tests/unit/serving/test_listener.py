"""The listening socket of our HTTP servers (worker/listener.py): connections accepted in batches however long
the event loop's iterations are (uvloop's libuv takes one per iteration), requests served through uvicorn on it,
TLS included, and a busy port named."""
from __future__ import annotations

import asyncio
import socket
import time

import httpx
import pytest
import uvicorn
import uvloop

from disagg.worker.listener import Acceptor, BatchAcceptServer, listening_sockets
from disagg.worker.local.self_signed import client_context, write_self_signed

BURST = 400


async def _accepted_in_a_busy_loop(listen: str, port: int) -> int:
    """Connections accepted within 2 s while every iteration of the loop runs a 20 ms callback (a flooded
    router's), with BURST clients connecting at once."""
    loop = asyncio.get_running_loop()
    accepted = []

    class Counting(asyncio.Protocol):
        def connection_made(self, transport):
            accepted.append(transport)

    if listen == "acceptor":
        server = Acceptor(loop, listening_sockets("127.0.0.1", port, 2048)[0], Counting)
    else:
        server = await loop.create_server(Counting, "127.0.0.1", port, backlog=2048)
    stop = False

    def busy():
        t = time.perf_counter()
        while time.perf_counter() - t < 0.02:
            pass
        if not stop:
            loop.call_soon(busy)

    clients = []
    for _ in range(BURST):
        c = socket.socket()
        c.setblocking(False)
        try:
            c.connect(("127.0.0.1", port))
        except BlockingIOError:
            pass
        clients.append(c)
    busy()
    await asyncio.sleep(2.0)
    stop = True
    n = len(accepted)
    server.close()
    for t in accepted:
        t.close()
    for c in clients:
        c.close()
    return n


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_busy_event_loop_still_accepts_a_burst_of_connections_at_once():
    """uvloop's own server takes one connection per loop iteration: ~100 in 2 s of 20 ms iterations, while
    the clients wait in the kernel's queue; the acceptor takes them all."""
    ours = uvloop.run(_accepted_in_a_busy_loop("acceptor", _free_port()))
    libuv = uvloop.run(_accepted_in_a_busy_loop("uvloop", _free_port()))
    assert ours == BURST, f"accepted {ours} of {BURST}"
    assert libuv < BURST / 2, f"uvloop's server took {libuv}: the premise of listener.py no longer holds"


async def _app(scope, receive, send):
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": b"hello"})


async def _serve_and_ask(config: uvicorn.Config, url: str, verify) -> list[int]:
    server = BatchAcceptServer(config)
    task = asyncio.ensure_future(server.serve())
    try:
        while not server.started:
            assert not task.done(), "the server did not start"
            await asyncio.sleep(0.02)
        async with httpx.AsyncClient(verify=verify, limits=httpx.Limits(max_keepalive_connections=0)) as client:
            replies = await asyncio.gather(*(client.get(url) for _ in range(20)))
        assert all(r.text == "hello" for r in replies)
        return [r.status_code for r in replies]
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 10)


def test_uvicorn_serves_through_the_acceptor_plain_and_tls(tmp_path):
    port = _free_port()
    config = uvicorn.Config(_app, host="127.0.0.1", port=port, lifespan="off", log_level="warning")
    assert uvloop.run(_serve_and_ask(config, f"http://127.0.0.1:{port}/", True)) == [200] * 20
    cert, key = map(str, write_self_signed(tmp_path / "tls", ["127.0.0.1"]))
    port = _free_port()
    config = uvicorn.Config(_app, host="127.0.0.1", port=port, lifespan="off", log_level="warning",
                            ssl_keyfile=key, ssl_certfile=cert)
    verify = client_context(cert)
    assert uvloop.run(_serve_and_ask(config, f"https://127.0.0.1:{port}/", verify)) == [200] * 20


def test_a_port_in_use_is_named_and_stops_the_start(caplog):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{port}"):
            listening_sockets("127.0.0.1", port, 16)
        server = BatchAcceptServer(uvicorn.Config(_app, host="127.0.0.1", port=port, lifespan="off"))
        with pytest.raises(SystemExit) as exit_:
            uvloop.run(server.serve())
        assert exit_.value.code != 0 and f"cannot listen on 127.0.0.1:{port}" in caplog.text


def test_closing_drops_a_connection_stuck_in_its_tls_handshake_at_once(tmp_path):
    """A client that connects to the TLS port and says nothing does not hold up the server's shutdown."""
    cert, key = map(str, write_self_signed(tmp_path / "tls", ["127.0.0.1"]))

    async def scenario() -> float:
        import ssl as ssl_

        context = ssl_.create_default_context(ssl_.Purpose.CLIENT_AUTH)
        context.load_cert_chain(cert, key)
        loop = asyncio.get_running_loop()
        acceptor = Acceptor(loop, listening_sockets("127.0.0.1", 0, 16)[0], asyncio.Protocol, ssl=context)
        silent = socket.create_connection(acceptor.sock.getsockname())
        while not acceptor._connecting:  # noqa: SLF001 - accepted, in its handshake
            await asyncio.sleep(0.01)
        started = time.monotonic()
        acceptor.close()
        await asyncio.wait_for(acceptor.wait_closed(), 5)
        silent.close()
        return time.monotonic() - started

    assert uvloop.run(scenario()) < 1.0
