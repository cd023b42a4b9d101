"""Settings the vLLM tier's tests share."""
from __future__ import annotations

import contextlib
import json
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import waiting
import yaml
from cores import usable_cores

from disagg.worker.local.launcher import FIRST_REQUEST_TIMEOUT_S

from vllm_fleet import ENGINE_ARGS, ENGINE_ENV, STARTUP_S, VLLM_ENV  # noqa: F401 (the tier's modules import them from here)

ALONE_ENV = {**ENGINE_ENV, "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, usable_cores()))}

MODEL = "tiny-vllm"
PROMPT = "In the morning the engineers measured the latency of every request twice and wrote it down"
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": PROMPT}]
KINDS = ("completion", "chat")

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
        # the launcher gives up by itself after startup_s (then stops its children) and its first request is
        # bounded too: wait past both, so that what it printed says why
        try:
            waiting.wait_for(lambda: serving_mark in text() or launcher.poll() is not None,
                             startup_s + FIRST_REQUEST_TIMEOUT_S + 30, "disagg up to serve", interval=0.5)
        except AssertionError as e:
            raise AssertionError(f"{e}\n{what_it_said(tmp, text())}") from None
        assert launcher.poll() is None, what_it_said(tmp, text())
        yield {"launcher": launcher, "output": text, "urls": dict(re.findall(r"(\S+)\s+ready\s+(http://\S+)", text())),
               "logs": tmp / "logs"}
    finally:
        if launcher.poll() is None:
            launcher.send_signal(signal.SIGTERM)
            launcher.wait(180)
        out.close()


def what_it_said(tmp: Path, launcher_output: str) -> str:
    """The launcher's output and the last lines of each process's log, for a failure message."""
    logs = sorted((tmp / "logs").glob("*.log"))
    return f"--- disagg up\n{launcher_output}" + "".join(
        f"\n--- {p.name}\n" + "\n".join(p.read_text(errors="replace").splitlines()[-30:]) for p in logs)


def generate(url: str, kind: str, stream: bool, max_tokens: int = 12) -> str:
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    body = {"model": MODEL, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": stream,
            **({"messages": MESSAGES} if kind == "chat" else {"prompt": PROMPT})}
    if not stream:
        r = httpx.post(url + path, json=body, timeout=300)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == max_tokens
        choice = r.json()["choices"][0]
        return choice["message"]["content"] if kind == "chat" else choice["text"]
    with httpx.stream("POST", url + path, json=body, timeout=300) as r:
        assert r.status_code == 200, r.read()
        lines = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]", lines
    text = ""
    for chunk in map(json.loads, lines[:-1]):
        assert "error" not in chunk, chunk
        for choice in chunk["choices"]:
            text += (choice["delta"].get("content") or "") if kind == "chat" else choice["text"]
    return text
