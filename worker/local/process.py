"""Local child processes for `disagg up` (launcher.py) and the local autoscaler (scaling.py): what to run
(ProcessSpec), running it in its own session with its log in a file (LocalProcess), waiting for readiness, the
ordered shutdown, and the launcher's own /health, /ready and /status server."""
from __future__ import annotations

import ctypes
import http.server
import json
import logging
import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from disagg.worker.ports import free_port  # noqa: F401 - the launcher's and the tests' import of it

logger = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1



# ---------------------------------------------------------------- ports and readiness (also used by tests)
def is_ready(url: str, timeout: float = 1.0, verify: Any = True) -> bool:
    """GET /ready; a server without one (vLLM: 404) is ready when its /health answers 200. `verify`: httpx's,
    for an HTTPS server (an ssl context trusting its certificate)."""
    try:
        code = httpx.get(f"{url}/ready", timeout=timeout, verify=verify).status_code
        if code == 404:
            code = httpx.get(f"{url}/health", timeout=timeout, verify=verify).status_code
        return code == 200
    except httpx.HTTPError:
        return False


@dataclass
class ProcessSpec:
    name: str  # prefill-0, decode-1, router
    argv: list[str]
    url: str  # base URL of its HTTP API
    env: dict[str, str] = field(default_factory=dict)
    role: str = ""  # prefill | decode | router
    kv_events: dict | None = None  # where it publishes KV-cache events (for the router's endpoints file)
    ca_file: str | None = None  # an HTTPS server's certificate, to verify it by (disagg up --tls)
    probe_url: str | None = None  # where its /ready answers, when not at `url` (Envoy: its admin)

    def verify(self) -> Any:
        """httpx's verify= for this process's URL."""
        from disagg.worker.local.self_signed import client_context

        return client_context(self.ca_file) if self.ca_file else True



def kill_group(pgid: int) -> bool:
    """SIGKILL what is left of process group `pgid` (its leader exited); whether anything was left."""
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def die_with_parent() -> None:
    # the child gets SIGTERM if the launcher dies without cleaning up (Linux)
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


class LocalProcess:
    def __init__(self, spec: ProcessSpec, log_dir: Path):
        self.spec = spec
        self.log_path = log_dir / f"{spec.name}.log"
        self.popen: subprocess.Popen | None = None
        self.started_at = 0.0
        self.state = "starting"  # starting | serving | leaving | draining (see scaling.WorkerSet)
        self.state_since = 0.0
        self._reaped: set[int] = set()  # pids whose process group was cleaned after they exited

    def start(self) -> None:
        log = self.log_path.open("ab")
        self.popen = subprocess.Popen(
            self.spec.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env={**os.environ, **self.spec.env}, start_new_session=True, preexec_fn=die_with_parent,
        )
        log.close()
        self.started_at = time.monotonic()

    def exited(self) -> int | None:
        """The exit status, None while running. The first time an exit is seen, whatever the process left running
        in its process group is killed (an engine's subprocesses orphaned when it was killed mid-start)."""
        rc = None if self.popen is None else self.popen.poll()
        if rc is not None and self.popen.pid not in self._reaped:
            self._reaped.add(self.popen.pid)
            if kill_group(self.popen.pid):
                logger.warning("%s exited; killed the processes it left in its group", self.spec.name)
        return rc

    def terminate(self) -> None:
        if self.popen is not None and self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        if self.popen is not None and self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait()
        self.exited()

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def wait_all_ready(procs: list[LocalProcess], deadline: float, stop: threading.Event, say: Any) -> bool:
    pending = list(procs)
    last_note = time.monotonic()
    while pending and not stop.is_set():
        for p in list(pending):
            rc = p.exited()
            if rc is not None:
                say(f"  {p.spec.name} exited with status {rc} while starting; last log lines "
                    f"({p.log_path}):\n{p.log_tail()}")
                return False
            if is_ready(p.spec.probe_url or p.spec.url, timeout=0.5, verify=True if p.spec.probe_url else p.spec.verify()):
                pending.remove(p)
                say(f"  {p.spec.name:<10} ready  {p.spec.url}  ({time.monotonic() - p.started_at:.1f}s)")
        if time.monotonic() > deadline:
            say(f"  timed out waiting for {', '.join(p.spec.name for p in pending)}; see {procs[0].log_path.parent}")
            return False
        if pending and time.monotonic() - last_note > 10:
            last_note = time.monotonic()
            say(f"  still starting: {', '.join(p.spec.name for p in pending)}")
        stop.wait(0.2)
    return not pending


FRONT_ROLES = ("router", "epp", "gateway")  # what clients reach: stopped before the workers


def shutdown(procs: list[LocalProcess], grace_s: float, say: Any) -> None:
    """The front door first (no new requests), then every worker drains; whatever outlives the grace is killed."""
    front = [p for p in procs if p.spec.role in FRONT_ROLES]
    for group in (front, [p for p in procs if p not in front]):
        for p in group:
            p.terminate()
        deadline = time.monotonic() + grace_s
        for p in group:
            if p.popen is None:
                continue
            try:
                p.popen.wait(max(deadline - time.monotonic(), 0.1))
                p.exited()
            except subprocess.TimeoutExpired:
                say(f"  {p.spec.name} did not stop within {grace_s:.0f}s; killing it")
                p.kill()


class _StatusHandler(http.server.BaseHTTPRequestHandler):
    ready: Any = staticmethod(lambda: False)  # () -> bool
    status: Any = staticmethod(lambda: {})  # () -> the /status JSON

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if self.path == "/health":
            code, body = 200, {"status": "ok"}
        elif self.path == "/ready":
            ok = self.ready()
            code, body = (200 if ok else 503), {"ready": ok}
        elif self.path == "/status":
            code, body = 200, self.status()
        else:
            code, body = 404, {"error": "not found"}
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


def start_status_server(host: str, port: int, ready: Any, status: Any) -> Any:
    """/health, /ready (every process up), /status (processes, replicas, the last autoscaling decision)."""
    handler = type("StatusHandler", (_StatusHandler,), {"ready": staticmethod(ready), "status": staticmethod(status)})
    server = http.server.ThreadingHTTPServer((host, port), handler)
    threading.Thread(target=server.serve_forever, name="status", daemon=True).start()
    return server
