"""Settings the vLLM tier's tests share."""
from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import waiting
import yaml

VLLM_ENV = "DISAGG_VLLM"  # the `vllm` executable (the launcher .ci/install-vllm.sh writes)
# what vLLM's CPU build needs on a small machine: a bounded KV cache (GiB). `disagg up` gives each vLLM process
# cores of its own (launcher.vllm_cpu_bind); one vLLM alone binds to every core
ENGINE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}
ALONE_ENV = {**ENGINE_ENV, "VLLM_CPU_OMP_THREADS_BIND": f"0-{max(0, (os.cpu_count() or 1) - 1)}"}


REPO = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "disagg.worker.cli"]


@contextlib.contextmanager
def disagg_up(spec: dict, tmp: Path, vllm_executable: str, port: int, startup_s: float, serving_mark: str,
              extra: list[str] = ()) -> Iterator[dict]:
    """`disagg up -f spec` with engine vllm until `serving_mark` is in its output (its logs in the failure
    message if it exits first); yields the launcher, its output reader and the workers' URLs; SIGTERM at the end."""
    spec_file = tmp / "spec.yaml"
    spec_file.write_text(yaml.safe_dump(spec))
    out = (tmp / "up.out").open("w")
    launcher = subprocess.Popen([*CLI, "up", "-f", str(spec_file), "--port", str(port), *extra, "--log-dir",
                                 str(tmp / "logs"), "--vllm", vllm_executable, "--startup-timeout", str(startup_s)],
                                stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
    text = lambda: (tmp / "up.out").read_text()  # noqa: E731
    try:
        waiting.wait_for(lambda: serving_mark in text() or launcher.poll() is not None, startup_s + 30,
                         "disagg up to serve", interval=0.5)
        assert launcher.poll() is None, text() + "".join(
            f"\n--- {p.name}\n" + "\n".join(p.read_text().splitlines()[-30:]) for p in (tmp / "logs").glob("*.log"))
        yield {"launcher": launcher, "output": text, "urls": dict(re.findall(r"(\S+)\s+ready\s+(http://\S+)", text())),
               "logs": tmp / "logs"}
    finally:
        if launcher.poll() is None:
            launcher.send_signal(signal.SIGTERM)
            launcher.wait(180)
        out.close()
