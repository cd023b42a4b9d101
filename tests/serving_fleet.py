"""Worker and router processes on loopback, started together for a test (free ports, readiness polled with a
deadline, SIGTERM at the end with the exit statuses returned). Shared by the serving and the fault tiers."""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from disagg.worker.local.process import LocalProcess, ProcessSpec, free_port, is_ready

CLI = [sys.executable, "-m", "disagg.worker.cli"]
WORKER_FLAGS = ["--host", "127.0.0.1", "--dtype", "float32", "--max-model-len", "512", "--num-kv-blocks", "256",
                "--served-model-name", "tiny-llama"]
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
    """Processes started together; `stop()` sends SIGTERM (after SIGCONT) and returns their exit statuses."""

    def __init__(self, log_dir: Path, worker_flags: list[str] | None = None):
        self.log_dir = log_dir
        self.worker_flags = WORKER_FLAGS if worker_flags is None else worker_flags
        self.procs: dict[str, LocalProcess] = {}
        self.killed: set[str] = set()  # names a test killed on purpose

    def worker(self, name: str, role: str, model: str, connector: str | None, lease_s: int = 5,
               extra: tuple[str, ...] = (), port: int | None = None, env: dict[str, str] | None = None) -> str:
        port = port or free_port()
        argv = [*CLI, "worker", "--role", role, "--model", model, "--port", str(port), *self.worker_flags,
                *connector_flags(connector, self.log_dir / "kv", lease_s), *extra]
        return self._start(ProcessSpec(name, argv, f"http://127.0.0.1:{port}", env or {}))

    def router(self, prefill: list[str], decode: list[str], extra: tuple[str, ...] = (), name: str = "router",
               env: dict[str, str] | None = None, ca_file: str | None = None) -> str:
        """`disagg router`; with `ca_file` it serves HTTPS (extra names its --tls-* files) and is probed so."""
        port = free_port()
        argv = [*CLI, "router", "--host", "127.0.0.1", "--port", str(port), "--probe-interval", "0.5",
                "--prefill", *prefill, "--decode", *decode, *extra]
        scheme = "https" if ca_file else "http"
        return self._start(ProcessSpec(name, argv, f"{scheme}://127.0.0.1:{port}", env or {}, ca_file=ca_file))

    def epp(self, prefill: list[str], decode: list[str], extra: tuple[str, ...] = (), name: str = "epp") -> int:
        """`disagg epp` on fresh ports; its ext_proc port is returned (its HTTP status port is its URL)."""
        grpc_port, health_port, http_port = free_port(), free_port(), free_port()
        argv = [*CLI, "epp", "--host", "127.0.0.1", "--grpc-port", str(grpc_port), "--health-port",
                str(health_port), "--metrics-port", str(http_port), "--probe-interval", "0.5",
                "--prefill", *prefill, "--decode", *decode, *extra]
        self._start(ProcessSpec(name, argv, f"http://127.0.0.1:{http_port}"))
        return grpc_port

    def envoy(self, picker_port: int, pool: list[str], failure_mode: str = "FailClose", name: str = "envoy",
              tls: tuple[str, str] | None = None) -> str:
        """A real Envoy as a GIE gateway (gateway/envoy_config.py) in front of `pool` (decode URLs, its
        fail-open fallback); returns its listener's URL (readiness is its admin's /ready). `tls`: (certificate,
        key) its listener serves HTTPS with."""
        import json
        from urllib.parse import urlsplit

        from disagg.worker.gateway.envoy import envoy_argv, find_envoy
        from disagg.worker.gateway.envoy_config import GatewayConfig, build_envoy_config, write_pool_endpoints

        eds = self.log_dir / f"{name}-pool" / "eds.json"
        eds.parent.mkdir(parents=True, exist_ok=True)
        write_pool_endpoints(eds, [(urlsplit(u).hostname, urlsplit(u).port) for u in pool])
        c = GatewayConfig("127.0.0.1", free_port(), "127.0.0.1", picker_port, str(eds), free_port(), failure_mode,
                          tls_cert_path=tls[0] if tls else None, tls_key_path=tls[1] if tls else None)
        config = self.log_dir / f"{name}.json"
        config.write_text(json.dumps(build_envoy_config(c)))
        self._start(ProcessSpec(name, envoy_argv(find_envoy(), str(config), concurrency=1),
                                f"http://127.0.0.1:{c.admin_port}"))
        return f"{'https' if tls else 'http'}://127.0.0.1:{c.listen_port}"

    def _start(self, spec: ProcessSpec) -> str:
        proc = LocalProcess(spec, self.log_dir)
        proc.start()
        self.procs[spec.name] = proc
        return spec.url

    def wait_ready(self, timeout_s: float = 180.0) -> None:
        deadline = time.monotonic() + timeout_s
        pending = {p for p in self.procs.values() if not is_ready(p.spec.url, verify=p.spec.verify())}
        while pending:
            for p in list(pending):
                assert p.exited() is None, f"{p.spec.name} exited early:\n{p.log_tail(40)}"
                if is_ready(p.spec.url, verify=p.spec.verify()):
                    pending.discard(p)
            assert time.monotonic() < deadline, f"not ready: {[p.spec.name for p in pending]}"
            time.sleep(0.1)

    def stop(self, timeout_s: float = 30.0) -> dict[str, int]:
        for p in self.procs.values():
            signal_group(p, signal.SIGCONT)  # a stopped (frozen) process would never act on SIGTERM
            p.terminate()
        codes = {}
        for name, p in self.procs.items():
            try:
                codes[name] = p.popen.wait(timeout_s)
            except subprocess.TimeoutExpired:
                p.kill()
                codes[name] = -9
        return codes




def signal_group(proc: LocalProcess, sig: signal.Signals) -> None:
    """The worker runs in a session of its own (LocalProcess): signal all of it, as a frozen node would be."""
    if proc.popen is not None and proc.popen.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.popen.pid, sig)
