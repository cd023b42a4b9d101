"""Our Envoy under refusals (envoy_config.py): a refused client keeps its connection, a flood of 429s is partly
shed by Envoy's admission control before it reaches the picker, and the picker hears the status of what it
routed (it asks for those response headers only). A real Envoy, the scripted picker, echoing model servers."""
from __future__ import annotations

import http.client
import json
import time

import httpx
import pytest

from disagg.worker.body_limit import DEFAULT_MAX_BODY_BYTES
from disagg.worker.gateway.envoy_config import SHED_MESSAGE
from test_envoy_protocol import PickerProcess, serve_echo, start_envoy

pytestmark = pytest.mark.slow


@pytest.fixture
def gateway(tmp_path):
    (a, a_port), (pool, pool_port) = serve_echo("a"), serve_echo("pool")
    picker = PickerProcess(f"127.0.0.1:{a_port}", "10.9.9.9:8000")
    admin: list[str] = []
    proc, url = start_envoy(tmp_path, picker.port, pool_port, "FailClose", duplex=False, admin=admin)
    yield url, admin[0]
    proc.terminate()
    proc.wait(10)
    picker.stop()
    for server in (a, pool):
        server.shutdown()


def _stat(admin: str, name: str) -> int:
    for line in httpx.get(f"{admin}/stats", params={"filter": f"^{name}$"}, timeout=5).text.splitlines():
        key, _, value = line.partition(": ")
        if key == name:
            return int(value)
    raise AssertionError(f"no stat {name}")


class Client:
    """One HTTP/1.1 connection that sends a request's headers and its body apart (as a client streaming its body
    does), and says whether the connection survived each answer."""

    def __init__(self, url: str):
        self.conn = http.client.HTTPConnection(url.removeprefix("http://"), timeout=10)
        self.sockets: set[int] = set()

    def post(self, path: str, body: bytes = b'{"prompt": "x"}') -> tuple[int, dict[str, str], dict]:
        self.conn.putrequest("POST", path)
        self.conn.putheader("content-type", "application/json")
        self.conn.putheader("content-length", str(len(body)))
        self.conn.endheaders()
        time.sleep(0.002)  # the body in a packet of its own
        self.conn.send(body)
        r = self.conn.getresponse()
        answer = json.loads(r.read())
        self.sockets.add(id(self.conn.sock))
        headers = {k.lower(): v for k, v in r.getheaders()}
        assert headers.get("connection", "").lower() != "close", (path, r.status, headers)
        return r.status, headers, answer


def test_a_refused_client_keeps_its_connection(gateway):
    """Refusals at the picker's body answer and at its headers answer, then a routed request: one connection
    (Envoy closes an HTTP/1.1 connection after a reply made before the request's body was read)."""
    url, _ = gateway
    client = Client(url)
    statuses = []
    for path in ("/shed", "/shed-early", "/shed-early", "/v1/completions"):
        status, headers, answer = client.post(path)
        statuses.append(status)
        if status == 429:
            assert headers["retry-after"] == "1" and answer["error"]["code"] == 429
    assert statuses == [429, 429, 429, 200] and len(client.sockets) == 1


def test_a_flood_of_refusals_is_shed_before_the_picker_and_recovers(gateway):
    """300 requests the picker refuses, on one connection: Envoy's admission control answers part of them itself
    (the same 429, Retry-After and error shape; the connection kept), each of those costing the picker no
    exchange; once the flood is past its sampling window, requests reach the picker again."""
    url, admin = gateway
    exchanges = _stat(admin, "cluster.endpoint_picker.upstream_rq_total")
    client = Client(url)
    answers = [client.post("/shed") for _ in range(300)]
    assert {status for status, _, _ in answers} == {429} and len(client.sockets) == 1
    assert all(h["retry-after"] == "1" and a["error"]["code"] == 429 and a["error"]["message"]
               for _, h, a in answers)
    envoys = [a for _, _, a in answers if a["error"]["message"] == SHED_MESSAGE]
    rejected = _stat(admin, "http.gateway.admission_control.rq_rejected")
    reached = _stat(admin, "cluster.endpoint_picker.upstream_rq_total") - exchanges
    assert len(envoys) == rejected > 0 and reached == 300 - rejected
    time.sleep(2.5)  # the sampling window (GatewayConfig.shed_window_s) forgets the flood
    assert [client.post("/v1/completions")[0] for _ in range(20)] == [200] * 20


def test_the_picker_hears_the_status_of_what_it_routed(gateway):
    url, _ = gateway
    first = httpx.post(f"{url}/status/429", content=b"{}", timeout=10)
    assert first.status_code == 429  # the model server's own 429 passes through
    seen = httpx.post(f"{url}/v1/completions", content=b"{}", timeout=10).json()
    assert seen["headers"]["x-picker-heard"] == "429"
    seen = httpx.post(f"{url}/v1/completions", content=b"{}", timeout=10).json()
    assert seen["headers"]["x-picker-heard"] == "200"


def test_the_gateway_reads_bodies_up_to_the_model_servers_limit(gateway):
    """The whole request is read before anything decides on it, up to the model servers' own body limit; above
    it the gateway answers 413 and nothing reaches the picker or a server."""
    url, _ = gateway
    big = json.dumps({"prompt": "p" * (3 * 2**20)}).encode()  # above Envoy's 1 MiB default buffer
    r = httpx.post(f"{url}/v1/completions", content=big, timeout=30)
    assert r.status_code == 200 and r.json()["body"].startswith(f"{len(big)}:")
    r = httpx.post(f"{url}/v1/completions", content=b"p" * (DEFAULT_MAX_BODY_BYTES + 1), timeout=30)
    assert r.status_code == 413
