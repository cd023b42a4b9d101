"""What the live-Prometheus monitoring test scrapes, per engine: the prefill and decode workers as that engine runs
them, an endpoint that crashes after a router saw it ready, and the labels the operator gives each component's
pods (the worker PodMonitor's relabelings read them)."""
from __future__ import annotations

import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import yaml
from serving_helpers import nixl_available
from vllm_fleet import pd_spec, vllm_executable
from waiting import wait_for

from disagg.operator import manifests, naming, spec as s
from disagg.worker.local.launcher import worker_spec
from disagg.worker.local.process import LocalProcess, ProcessSpec, free_port, is_ready

REPO = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "disagg.worker.cli"]


class CrashingPrefill:
    """An endpoint that passes the router's readiness probe; crash() closes it, as a prefill pod that died."""

    def __init__(self, model: str) -> None:
        models = json.dumps({"object": "list", "data": [{"id": model}]}).encode()

        class Probe(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                body = b"" if self.path == "/metrics" else models
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Probe)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def crash(self) -> None:
        if self.server.socket.fileno() != -1:
            self.server.shutdown()
            self.server.server_close()


def operator_pod_labels(namespace: str, instance: str) -> dict[str, dict[str, str]]:
    """component -> the labels the operator gives that component's pods (the example resource's Deployments)."""
    example = yaml.safe_load((REPO / "examples" / "llama3-8b-gpu.yaml").read_text())
    owner = manifests.Owner(name=instance, namespace=namespace, uid="uid-1")
    deployments = [d for d in manifests.desired_children(owner, s.parse_spec(example["spec"]))
                   if d["kind"] == "Deployment"]
    return {d["metadata"]["labels"][naming.LABEL_COMPONENT]: d["spec"]["template"]["metadata"]["labels"]
            for d in deployments}


def worker_processes(engine: str, model_dir: str, model: str, work: Path,
                     disagg_flags: list[str]) -> dict[str, ProcessSpec]:
    """role -> the prefill's and the decode's process: engine vllm as `disagg up` plans it (`vllm serve`, NIXL,
    a core each), engine disagg as `disagg worker` with `disagg_flags` (NIXL where it is installed)."""
    if engine == "vllm":
        spec = pd_spec(model_dir, model)
        for role in ("prefill", "decode"):
            # 64 blocks (8192 tokens), not 1 GiB: registering a GiB with NIXL took minutes on a busy 2-core box
            spec[role]["extraArgs"] = ["--num-gpu-blocks-override", "64"]
        spec = s.parse_spec(spec)
        return {role: worker_spec(spec, role, 0, model_dir, "127.0.0.1", free_port, str(work / "kv"), [],
                                  vllm_executable()) for role in ("prefill", "decode")}
    connector = ["--kv-connector", "NixlConnector", "--kv-side-channel-host", "127.0.0.1"] if nixl_available() \
        else ["--kv-connector", "SharedStorageConnector", "--kv-shared-storage-path", str(work / "kv")]
    out = {}
    for role in ("prefill", "decode"):
        port = free_port()
        side = ["--kv-side-channel-port", str(free_port())] if nixl_available() else []
        out[role] = ProcessSpec(role, [*CLI, "worker", "--role", role, "--model", model_dir, "--port", str(port),
                                       *disagg_flags, *connector, *side], f"http://127.0.0.1:{port}")
    return out


def start_ready(procs: list[LocalProcess], timeout_s: float) -> None:
    """Start them all, then wait for each to be ready (failing with its log if it exits first)."""
    for p in procs:
        p.start()
    for p in procs:
        wait_for(lambda: p.exited() is not None or is_ready(p.spec.url), timeout_s, f"{p.spec.name} ready",
                 interval=0.2)
        assert p.exited() is None, f"{p.spec.name} exited:\n{p.log_tail(40)}"
