"""The API client re-reads a rotated service-account token file (in-cluster), and keeps a fixed token otherwise."""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Iterator

import pytest

from disagg.operator.kube import Connection, KubeClient


class _Recorder(BaseHTTPRequestHandler):
    seen: list[str | None]  # the Authorization header of each request, set per server below

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        self.server.seen.append(self.headers.get("Authorization"))  # type: ignore[attr-defined]
        body = json.dumps({"kind": "Deployment", "metadata": {"name": "x"}}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_: object) -> None:
        pass


@pytest.fixture
def api_server() -> Iterator[ThreadingHTTPServer]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)  # a free port
    server.seen = []  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _server_url(server: ThreadingHTTPServer) -> str:
    host, port = server.server_address[:2]
    return f"http://{host}:{port}"


def _get(client: KubeClient) -> None:
    assert client.get("apps/v1", "Deployment", "ns", "x") is not None


def test_rotated_token_file_is_reread_after_the_refresh_period(api_server, tmp_path: Path):
    token_file = tmp_path / "token"
    token_file.write_text("first")
    clock = _Clock()
    client = KubeClient(Connection(server=_server_url(api_server), token="first", token_path=str(token_file)),
                        clock=clock, token_refresh_seconds=60)
    try:
        _get(client)
        token_file.write_text("second")  # the kubelet rotates the projected token
        clock.now += 59
        _get(client)  # not yet re-read
        clock.now += 1
        _get(client)
        token_file.unlink()  # a failed read keeps the token in use
        clock.now += 120
        _get(client)
    finally:
        client.close()
    assert api_server.seen == ["Bearer first", "Bearer first", "Bearer second", "Bearer second"]


def test_explicit_token_without_a_file_stays_fixed(api_server, tmp_path: Path):
    clock = _Clock()
    client = KubeClient(Connection(server=_server_url(api_server), token="fixed"), clock=clock)
    try:
        _get(client)
        clock.now += 3600
        _get(client)
    finally:
        client.close()
    assert api_server.seen == ["Bearer fixed", "Bearer fixed"]


def test_in_cluster_connection_names_the_token_file(api_server, tmp_path: Path, monkeypatch):
    from kubernetes.config import incluster_config

    from disagg.operator.kube import load_connection

    token_file, ca_file = tmp_path / "token", tmp_path / "ca.crt"
    token_file.write_text("first")
    ca_file.write_text("not a real CA, only read for emptiness")
    monkeypatch.setattr(incluster_config, "SERVICE_TOKEN_FILENAME", str(token_file))
    monkeypatch.setattr(incluster_config, "SERVICE_CERT_FILENAME", str(ca_file))
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    conn = load_connection()
    assert (conn.token, conn.token_path) == ("first", str(token_file))
    clock = _Clock()
    client = KubeClient(Connection(server=_server_url(api_server), token=conn.token, token_path=conn.token_path),
                        clock=clock)
    try:
        token_file.write_text("second")
        clock.now += 60
        _get(client)
    finally:
        client.close()
    assert api_server.seen == ["Bearer second"]
