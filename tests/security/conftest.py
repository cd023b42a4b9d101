"""The hostile-input tier: real `disagg worker`, `router`, `epp` (through a real Envoy) and `pd-proxy` processes on
loopback, each module one fleet. What a hostile input must not reach is a listening socket on an address of its
own (127.0.0.x) that counts every connection made to it."""
from __future__ import annotations

import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from disagg.worker.kv_transfer.handoff_auth import KEY_ENV, RESOURCE_ENV, HandoffSigner, decode_key, new_key
from disagg.worker.ports import free_port
from serving_fleet import Fleet  # noqa: F401 (the tests import it here)

pytestmark = pytest.mark.slow
RESOURCE = "team-a/llama"


@pytest.fixture(scope="session")
def handoff_key() -> str:
    return new_key()


@pytest.fixture(scope="session")
def handoff_env(handoff_key) -> dict[str, str]:
    """What the operator's Secret gives every worker of one resource."""
    return {KEY_ENV: handoff_key, RESOURCE_ENV: RESOURCE}


@pytest.fixture(scope="session")
def signer(handoff_key) -> HandoffSigner:
    """The resource's key in the test's hands: to make hand-offs the workers must take (and tokens)."""
    return HandoffSigner(decode_key(handoff_key, "test"), RESOURCE)


class _Refuse(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802
        self.send_error(404)

    def log_message(self, *args) -> None:
        pass


class Bystander:
    """An HTTP server on 127.0.0.`last` that answers every request 404 and counts the connections it accepted:
    the host a hostile hand-off names. A worker that connects to it gets nothing it can use."""

    def __init__(self, last: int):
        self.host, self.port = f"127.0.0.{last}", free_port()
        self.connections = 0
        counter = self

        class Server(ThreadingHTTPServer):
            daemon_threads = True

            def verify_request(self, request: socket.socket, client_address) -> bool:
                counter.connections += 1
                return True

        self._server = Server((self.host, self.port), _Refuse)
        threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


@pytest.fixture
def bystander_factory():
    made: list[Bystander] = []

    def make(last: int) -> Bystander:
        made.append(Bystander(last))
        return made[-1]

    yield make
    for b in made:
        b.close()
