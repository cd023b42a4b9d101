"""TLS on real processes: a router (--tls-cert-file/--tls-key-file) and the gateway path's Envoy listener
(GatewayConfig's certificate) with a self-signed pair (the one `disagg up --tls` makes). A client that trusts the
certificate is served; one that does not is refused at the handshake; a plaintext request to the TLS port fails
cleanly - its connection closed, nothing answered in the clear - and the server goes on serving."""
from __future__ import annotations

import socket

import httpx
import pytest

from disagg.worker.local.self_signed import client_context, write_self_signed
from security_helpers import MODEL

pytestmark = pytest.mark.slow

BODY = {"model": MODEL, "prompt": "over TLS", "max_tokens": 2}


@pytest.fixture(scope="module")
def fleet(tiny_model_dir, tmp_path_factory):
    from serving_fleet import Fleet

    tmp = tmp_path_factory.mktemp("tls-ports")
    cert, key = map(str, write_self_signed(tmp / "tls", ["127.0.0.1"]))
    f = Fleet(tmp)
    worker = f.worker("both", "both", tiny_model_dir, None)
    f.wait_ready()
    router = f.router([], [worker], extra=("--tls-cert-file", cert, "--tls-key-file", key), ca_file=cert)
    gateway = f.envoy(f.epp([], [worker]), [worker], tls=(cert, key))
    f.wait_ready()
    yield {"router": router, "gateway": gateway, "trust": client_context(cert)}
    assert set(f.stop().values()) == {0}


@pytest.mark.parametrize("server", ["router", "gateway"])
def test_a_client_that_trusts_the_certificate_is_served_and_others_are_refused(fleet, server):
    url = fleet[server]
    assert url.startswith("https://")
    r = httpx.post(f"{url}/v1/completions", json=BODY, timeout=60, verify=fleet["trust"])
    assert r.status_code == 200, r.text
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.post(f"{url}/v1/completions", json=BODY, timeout=10)  # the system's trust store knows no such CA


@pytest.mark.parametrize("server", ["router", "gateway"])
def test_a_plaintext_request_to_the_tls_port_fails_cleanly_and_the_server_keeps_serving(fleet, server):
    url = fleet[server]
    plain = url.replace("https://", "http://")
    with pytest.raises(httpx.TransportError):
        httpx.post(f"{plain}/v1/completions", json=BODY, timeout=10)
    host, port = url.removeprefix("https://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:  # raw: nothing comes back in the clear
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = b""
        try:
            while chunk := s.recv(4096):
                answer += chunk
        except ConnectionResetError:
            pass
    assert b"HTTP/1.1 200" not in answer and b"status" not in answer
    r = httpx.post(f"{url}/v1/completions", json=BODY, timeout=60, verify=fleet["trust"])
    assert r.status_code == 200, r.text
