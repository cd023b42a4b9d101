"""Side channel: metadata round trip over loopback and one clear error per failure mode."""
from __future__ import annotations

import dataclasses
import json
import socket
import threading

import pytest

from disagg.worker.kv_transfer.side_channel import (
    PROTOCOL_VERSION,
    EngineMetadata,
    MalformedMetadata,
    ProtocolVersionMismatch,
    SideChannelServer,
    SideChannelTimeout,
    SideChannelUnreachable,
    compat_fields,
    compat_hash,
    fetch_engine_metadata,
)

HOST = "127.0.0.1"


def make_metadata(engine_id: str = "prefill-0") -> EngineMetadata:
    fields = compat_fields("m", "bfloat16", 32, 8, 128, 16)
    return EngineMetadata(engine_id=engine_id, agent_name=engine_id, agent_metadata=bytes(range(256)) * 3,
                          kv_base_addr=0x7F00_0000_1000, bytes_per_block=131072, num_blocks=128,
                          device_kind="DRAM", device_id=0, compat=fields, compat_hash=compat_hash(fields))


def test_round_trip_and_clean_shutdown():
    threads_before = set(threading.enumerate())
    md = make_metadata()
    with SideChannelServer(md, HOST, 0) as server:
        assert server.port > 0
        got = fetch_engine_metadata(HOST, server.port, timeout=2.0)
        assert got == md
        assert got.dtype == "bfloat16" and got.layout == md.compat["layout"]
        server.set_metadata(dataclasses.replace(md, num_blocks=7))  # e.g. re-registered
        assert fetch_engine_metadata(HOST, server.port, timeout=2.0).num_blocks == 7
    server.close()  # idempotent
    assert set(threading.enumerate()) <= threads_before
    with pytest.raises(SideChannelUnreachable, match=f"{HOST}:{server.port}: connection refused"):
        fetch_engine_metadata(HOST, server.port, timeout=1.0)


def test_connection_refused_names_host_port():
    with socket.socket() as s:  # a port that was free a moment ago and has no listener now
        s.bind((HOST, 0))
        port = s.getsockname()[1]
    with pytest.raises(SideChannelUnreachable, match=f"side channel {HOST}:{port}: connection refused"):
        fetch_engine_metadata(HOST, port, timeout=1.0)


def test_timeout_names_host_port():
    with socket.socket() as listener:  # accepts connections (backlog) but never answers
        listener.bind((HOST, 0))
        listener.listen(1)
        port = listener.getsockname()[1]
        with pytest.raises(SideChannelTimeout, match=f"side channel {HOST}:{port}: no answer within 0.3s"):
            fetch_engine_metadata(HOST, port, timeout=0.3)


class _FixedResponder:
    """Answers every connection with one fixed raw HTTP response."""

    def __init__(self, status: int, body: bytes):
        self.sock = socket.socket()
        self.sock.bind((HOST, 0))
        self.sock.listen(4)
        self.sock.settimeout(5.0)
        self.port = self.sock.getsockname()[1]
        self.response = (f"HTTP/1.1 {status} X\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
                         .encode() + body)
        self.thread = threading.Thread(target=self._serve_one, daemon=True)
        self.thread.start()

    def _serve_one(self) -> None:
        conn, _ = self.sock.accept()
        with conn:
            conn.recv(65536)
            conn.sendall(self.response)

    def __enter__(self) -> "_FixedResponder":
        return self

    def __exit__(self, *exc: object) -> None:
        self.thread.join(timeout=5.0)
        self.sock.close()


def _body(**changes) -> bytes:
    body = json.loads(make_metadata().to_json())
    body.update(changes)
    return json.dumps({k: v for k, v in body.items() if v is not None}).encode()


@pytest.mark.parametrize(
    "status, body, error, message",
    [
        (200, b"<html>not json</html>", MalformedMetadata, "body is not JSON"),
        (200, b"[1, 2]", MalformedMetadata, "expected a JSON object, got list"),
        (200, _body(protocol_version=PROTOCOL_VERSION + 1), ProtocolVersionMismatch,
         f"protocol_version={PROTOCOL_VERSION + 1}, expected {PROTOCOL_VERSION}"),
        (200, b'{"engine_id": "x"}', ProtocolVersionMismatch, "protocol_version=None"),
        (200, _body(num_blocks=None), MalformedMetadata, "num_blocks"),
        (200, _body(num_blocks="128"), MalformedMetadata, "field num_blocks='128' should be int"),
        (200, _body(agent_metadata="!!not base64!!"), MalformedMetadata, "bad metadata"),
        (200, _body(device_kind="TPU"), MalformedMetadata, "device_kind='TPU'"),
        (200, _body(surprise=1), MalformedMetadata, "surprise"),
        (404, b"", MalformedMetadata, "HTTP 404"),
    ],
)
def test_bad_answers_are_named(status, body, error, message):
    with _FixedResponder(status, body) as responder:
        with pytest.raises(error, match=f"side channel {HOST}:{responder.port}: .*{message}"):
            fetch_engine_metadata(HOST, responder.port, timeout=2.0)


def test_unknown_path_is_404():
    with SideChannelServer(make_metadata(), HOST, 0) as server:
        import http.client

        conn = http.client.HTTPConnection(HOST, server.port, timeout=2.0)
        conn.request("GET", "/other")
        assert conn.getresponse().status == 404
        conn.close()


def test_with_a_key_metadata_goes_only_to_an_asker_with_a_token_of_that_key():
    from disagg.worker.kv_transfer.handoff_auth import HandoffSigner
    from disagg.worker.kv_transfer.side_channel import SideChannelForbidden

    ours, theirs = HandoffSigner(b"k" * 32, "ns/a"), HandoffSigner(b"x" * 32, "ns/a")
    md = make_metadata()
    with SideChannelServer(md, HOST, 0, auth=ours) as server:
        assert fetch_engine_metadata(HOST, server.port, 2.0, ours, "decode-0") == md
        for auth in (None, theirs):
            with pytest.raises(SideChannelForbidden, match=f"{HOST}:{server.port}: our token was refused"):
                fetch_engine_metadata(HOST, server.port, 2.0, auth, "decode-0")
        # a token made for another agent name does not open it either
        import http.client

        conn = http.client.HTTPConnection(HOST, server.port, timeout=2.0)
        conn.request("GET", "/metadata", headers={"X-Disagg-Agent": "decode-1",
                                                  "X-Disagg-Token": ours.token("metadata", "decode-0")})
        r = conn.getresponse()
        assert r.status == 403 and md.agent_metadata not in r.read()
        conn.close()
