"""The router's pooled connections to a worker expire before the worker's HTTP server closes them: a request written
to a connection the server is closing at that moment is reset unanswered (a CI run's decode hop: ReadError, then a
503 with no other decode left). A real uvicorn server with its default keep-alive (ours and vLLM's workers both
run uvicorn's default) and the router's own client."""
from __future__ import annotations

import asyncio
import threading
import time

import httpx
import uvicorn

from disagg.worker.ports import free_port
from disagg.worker.router.routing import worker_client


def test_an_idle_connection_is_dropped_by_the_router_before_the_worker_would_close_it():
    peers: list[tuple[str, int]] = []

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        peers.append(tuple(scope["client"]))
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"ok"})

    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning")
    server_idle_s = config.timeout_keep_alive
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.02)

        async def two_requests(gap_s: float) -> None:
            async with worker_client() as client:
                for i in range(2):
                    if i:
                        await asyncio.sleep(gap_s)
                    r = await client.get(f"http://127.0.0.1:{port}/health")
                    assert r.status_code == 200

        asyncio.run(two_requests(0.1))  # back to back: one connection, reused
        assert peers[0] == peers[1]
        # idle for most of the server's keep-alive: the server still holds the connection, the router must not
        asyncio.run(two_requests(server_idle_s - 1.5))
        assert peers[2] != peers[3], "the router reused a connection idle for nearly the worker's keep-alive"
    finally:
        server.should_exit = True
        thread.join(10)
