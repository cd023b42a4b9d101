"""Helpers of the router and operator fault tests (imported by tests/faults/test_router_*.py and
test_operator_*.py; tests/faults/conftest.py belongs to the KV-transfer fault tests):

- a P/D fleet on loopback (worker and router processes) whose router has short bounds;
- freezing a worker the way a hung node does (SIGSTOP of its process group), always thawed at the end;
- "nothing left behind": no running or waiting requests, no pending KV sends/loads, KV usage back to idle;
- Link: a TCP relay that can refuse connections, cut open ones (watches), answer 503 or hang - put in front of
  the emulated API server (fixture `api`) or a worker's /metrics.
"""
from __future__ import annotations

import contextlib
import selectors
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

import serving_fleet
from serving_fleet import signal_group

from disagg.worker.local.process import LocalProcess, free_port

# the operator tests' emulator and harness (tests/integration/operator) are plain modules there
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration" / "operator"))

WORKER_FLAGS = ["--host", "127.0.0.1", "--dtype", "float32", "--max-model-len", "512", "--num-kv-blocks", "128",
                "--served-model-name", "tiny-llama"]
LEASE_S = 3  # KV a decode never pulled is freed after this
IDLE_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "disagg:kv_pending_sends",
               "disagg:kv_pending_loads", "vllm:kv_cache_usage_perc")


# ---------------------------------------------------------------- processes
class Fleet(serving_fleet.Fleet):
    """Workers with the shared-storage connector (a short lease) and a router with the test's bounds."""

    def __init__(self, log_dir: Path):
        super().__init__(log_dir, WORKER_FLAGS)

    def worker(self, name: str, role: str, model: str) -> str:  # type: ignore[override]
        return super().worker(name, role, model, "SharedStorageConnector", lease_s=LEASE_S)

    def router(self, prefill: list[str], decode: list[str], bounds: list[str],  # type: ignore[override]
               name: str = "router") -> str:
        return super().router(prefill, decode, tuple(bounds), name)  # a later --probe-interval in bounds wins


@contextlib.contextmanager
def frozen(*procs: LocalProcess) -> Iterator[None]:
    """SIGSTOP for the block; SIGCONT however it ends."""
    for p in procs:
        signal_group(p, signal.SIGSTOP)
    try:
        yield
    finally:
        for p in procs:
            signal_group(p, signal.SIGCONT)


# ---------------------------------------------------------------- metrics
def gauges(url: str) -> dict[str, float]:
    """The idle gauges of a worker, summed over label sets."""
    out = dict.fromkeys(IDLE_GAUGES, 0.0)
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=5).text):
        for s in family.samples:
            if s.name in out:
                out[s.name] += s.value
    return out


def router_counter(url: str, name: str, **labels: str) -> float:
    """A router counter's value summed over the label sets that match `labels`."""
    total = 0.0
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=5).text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


def wait_idle(urls: list[str], timeout_s: float = LEASE_S + 20.0) -> None:
    """Nothing left on any worker: no running or waiting request, no pending KV send or load, no KV held
    (an abandoned prefill's KV goes at its lease)."""
    deadline = time.monotonic() + timeout_s
    while True:
        busy = {u: {k: v for k, v in gauges(u).items() if v} for u in urls}
        busy = {u: g for u, g in busy.items() if g}
        if not busy:
            return
        assert time.monotonic() < deadline, f"workers not idle after {timeout_s} s: {busy}"
        time.sleep(0.2)


# ---------------------------------------------------------------- a link that can fail
UNAVAILABLE = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nConnection: close\r\n"
               b"Content-Length: %d\r\n\r\n%s")
STATUS_503 = (b'{"kind":"Status","apiVersion":"v1","status":"Failure","reason":"ServiceUnavailable",'
              b'"message":"the server is currently unable to handle the request (injected)","code":503}')


class Link:
    """127.0.0.1:<port> relayed to 127.0.0.1:<target_port>, for a client that must not know: up(mode)
    listens on the same port each time - "relay" passes bytes both ways, "503" answers every HTTP request with
    503 Service Unavailable, "hang" accepts and never answers; down() resets every open connection (watches
    included) and refuses new ones, as a server that went away."""

    def __init__(self, target_port: int):
        self.target_port = target_port
        self.port = free_port()
        self.mode = "relay"
        self._listener: socket.socket | None = None
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def up(self, mode: str = "relay") -> None:
        self.down()
        self.mode = mode
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", self.port))
        s.listen(64)
        self._listener = s
        self._stop.clear()
        self._thread = threading.Thread(target=self._accept, args=(s,), name="link", daemon=True)
        self._thread.start()

    def down(self) -> None:
        self._stop.set()
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None
        with self._lock:
            conns, self._conns = self._conns, set()
        for c in conns:
            with contextlib.suppress(OSError):
                c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # RST
                c.close()

    def _accept(self, listener: socket.socket) -> None:
        listener.settimeout(0.1)
        while not self._stop.is_set():
            try:
                client, _ = listener.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            with self._lock:
                self._conns.add(client)
            if self.mode == "relay":
                try:
                    server = socket.create_connection(("127.0.0.1", self.target_port))
                except OSError:
                    client.close()
                    continue
                with self._lock:
                    self._conns.add(server)
                threading.Thread(target=self._pipe, args=(client, server), daemon=True).start()
            elif self.mode == "503":
                threading.Thread(target=self._unavailable, args=(client,), daemon=True).start()
            # "hang": kept open, never read, never answered, until down()

    def _unavailable(self, client: socket.socket) -> None:
        """Answer each request on the connection with a 503, then close it."""
        with contextlib.suppress(OSError):
            client.settimeout(5)
            data = b""
            while b"\r\n\r\n" not in data:
                chunk = client.recv(65536)
                if not chunk:
                    return
                data += chunk
            client.sendall(UNAVAILABLE % (len(STATUS_503), STATUS_503))
            client.close()

    def _pipe(self, a: socket.socket, b: socket.socket) -> None:
        sel = selectors.DefaultSelector()
        try:
            sel.register(a, selectors.EVENT_READ, b)
            sel.register(b, selectors.EVENT_READ, a)
            while not self._stop.is_set():
                for key, _ in sel.select(0.2):
                    data = key.fileobj.recv(65536)
                    if not data:
                        return
                    key.data.sendall(data)
        except (OSError, ValueError):
            return
        finally:
            sel.close()
            with self._lock:
                self._conns -= {a, b}
            for s in (a, b):
                with contextlib.suppress(OSError):
                    s.close()


# ---------------------------------------------------------------- the emulated API server behind a link
@pytest.fixture(name="api")
def api_fixture(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Any, Link]]:
    """(the emulated API server, the link the operator reaches it through); KUBECONFIG names the link. The test
    itself talks to the emulator directly (`api.client()`), as another user of a working API server would."""
    from emulator import EmulatorThread, Kind
    from operator_harness import CR

    from disagg.operator import spec as s

    with EmulatorThread() as server:
        server.emulator.declare(*CR, Kind(s.KIND, status_subresource=True, short_names=tuple(s.SHORT_NAMES)))
        with server.client() as http:
            http.post("/api/v1/namespaces", json={"metadata": {"name": "default"}}).raise_for_status()
        link = Link(int(server.url.rsplit(":", 1)[1]))
        link.up()
        config = server.kubeconfig()
        config["clusters"][0]["cluster"]["server"] = link.url
        kubeconfig = tmp_path / "kubeconfig.yaml"
        kubeconfig.write_text(yaml.safe_dump(config))
        monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
        monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
        try:
            yield server, link
        finally:
            link.down()


@pytest.fixture(name="example")
def example_fixture() -> dict[str, Any]:
    from operator_harness import EXAMPLES

    return yaml.safe_load((EXAMPLES / "llama3-8b-gpu.yaml").read_text())
