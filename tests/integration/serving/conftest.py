"""Worker and router processes on loopback for the serving tests (free ports, readiness polled with a
deadline, SIGTERM at the end with the exit status checked)."""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from serving_helpers import NIXL_MISSING, nixl_available

from disagg.worker.local.process import LocalProcess, ProcessSpec, free_port, is_ready

CLI = [sys.executable, "-m", "disagg.worker.cli"]
WORKER_FLAGS = ["--host", "127.0.0.1", "--dtype", "float32", "--max-model-len", "512", "--num-kv-blocks", "256",
                "--served-model-name", "tiny-llama"]
CONNECTORS = [
    pytest.param("SharedStorageConnector", id="shared-storage"),
    pytest.param("NixlConnector", id="nixl", marks=pytest.mark.skipif(not nixl_available(), reason=NIXL_MISSING)),
]


def connector_flags(connector: str | None, kv_dir: Path, lease_s: int) -> list[str]:
    if connector is None:
        return []
    flags = ["--kv-connector", connector, "--kv-lease-seconds", str(lease_s)]
    if connector == "NixlConnector":
        flags += ["--kv-side-channel-host", "127.0.0.1", "--kv-side-channel-port", str(free_port())]
    elif connector == "SharedStorageConnector":
        flags += ["--kv-shared-storage-path", str(kv_dir)]
    return flags


class Fleet:
    """Processes started together; `stop()` sends SIGTERM and returns their exit statuses."""

    def __init__(self, log_dir: Path):
        self.log_dir = log_dir
        self.procs: dict[str, LocalProcess] = {}
        self.killed: set[str] = set()  # names a test killed on purpose

    def worker(self, name: str, role: str, model: str, connector: str | None, lease_s: int = 5,
               extra: tuple[str, ...] = (), port: int | None = None) -> str:
        port = port or free_port()
        argv = [*CLI, "worker", "--role", role, "--model", model, "--port", str(port), *WORKER_FLAGS,
                *connector_flags(connector, self.log_dir / "kv", lease_s), *extra]
        return self._start(ProcessSpec(name, argv, f"http://127.0.0.1:{port}"))

    def router(self, prefill: list[str], decode: list[str], extra: tuple[str, ...] = ()) -> str:
        port = free_port()
        argv = [*CLI, "router", "--host", "127.0.0.1", "--port", str(port), "--probe-interval", "0.5",
                "--prefill", *prefill, "--decode", *decode, *extra]
        return self._start(ProcessSpec("router", argv, f"http://127.0.0.1:{port}"))

    def _start(self, spec: ProcessSpec) -> str:
        proc = LocalProcess(spec, self.log_dir)
        proc.start()
        self.procs[spec.name] = proc
        return spec.url

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        pending = {p for p in self.procs.values() if not is_ready(p.spec.url)}
        while pending:
            for p in list(pending):
                assert p.exited() is None, f"{p.spec.name} exited early:\n{p.log_tail(40)}"
                if is_ready(p.spec.url):
                    pending.discard(p)
            assert time.monotonic() < deadline, f"not ready: {[p.spec.name for p in pending]}"
            time.sleep(0.1)

    def stop(self, timeout_s: float = 30.0) -> dict[str, int]:
        for p in self.procs.values():
            p.terminate()
        codes = {}
        for name, p in self.procs.items():
            try:
                codes[name] = p.popen.wait(timeout_s)
            except subprocess.TimeoutExpired:
                p.kill()
                codes[name] = -9
        return codes


@pytest.fixture(scope="module")
def reference(tiny_model_dir, tmp_path_factory):
    fleet = Fleet(tmp_path_factory.mktemp("reference"))
    url = fleet.worker("both", "both", tiny_model_dir, None)
    yield fleet, url
    assert fleet.stop() == {"both": 0}


@pytest.fixture(scope="module", params=CONNECTORS)
def pd(request, tiny_model_dir, tmp_path_factory, reference):
    fleet = Fleet(tmp_path_factory.mktemp(request.param))
    prefill = fleet.worker("prefill", "prefill", tiny_model_dir, request.param, lease_s=3)
    decodes = [fleet.worker(f"decode-{i}", "decode", tiny_model_dir, request.param) for i in range(2)]
    reference[0].wait_ready()
    fleet.wait_ready()
    router = fleet.router([prefill], decodes)
    fleet.wait_ready()
    yield {"fleet": fleet, "router": router, "prefill": prefill, "decodes": decodes, "reference": reference[1],
           "connector": request.param}
    codes = fleet.stop()
    killed = fleet.killed
    assert {n: c for n, c in codes.items() if n not in killed} == {n: 0 for n in codes if n not in killed}
