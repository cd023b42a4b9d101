"""What hostile-input tests of every tier share (tests/security against a fleet and `disagg up`, tests/cluster
against pods): the host a hostile P/D hand-off names - a listening socket on an address of its own (127.0.0.x)
that counts every connection made to it, so a test shows that nothing connected - and the hand-offs such a
client makes: unsigned, signed with a key or for a resource of its own, or a genuine one changed."""
from __future__ import annotations

import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from disagg.worker.kv_transfer.handoff import Handoff, RemoteKV
from disagg.worker.kv_transfer.handoff_auth import HandoffSigner
from disagg.worker.ports import free_port


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


def pointing_at(host: str, port: int, signer: HandoffSigner | None, lease_in_s: float = 30) -> dict:
    """kv_transfer_params naming blocks 0 and 1 of a made-up request at host:port, signed by `signer` (None:
    unsigned)."""
    h = Handoff(do_remote_prefill=True, remote=RemoteKV("engine-x", (0, 1), host, port, "req-x",
                                                        time.time() + lease_in_s))
    return (signer.sign(h) if signer is not None else h).to_wire()


def stranger(resource: str) -> HandoffSigner:
    """A signer with a key of its own, made out for `resource`: what a client without the resource's key has."""
    return HandoffSigner(b"z" * 32, resource)


NO_CONNECTION_WAIT_S = 1.5  # a worker's handshake runs in a background thread: give a wrong one time to show


def assert_refused(response, status: int, words: str, bystander: Bystander | None = None) -> None:
    """The decode worker's answer names what is wrong with the hand-off, and the host it named saw nothing."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert words in error["message"] and error["code"] == status, error
    assert error["param"].startswith("kv_transfer_params."), error
    if bystander is not None:
        time.sleep(NO_CONNECTION_WAIT_S)
        assert bystander.connections == 0, "the decode worker connected to the host a refused hand-off named"
