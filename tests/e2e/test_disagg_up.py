"""`disagg up` end to end: router + 1 prefill + 1 decode as local processes from a DisaggregatedInference
spec, once per KV connector (NIXL is the point; shared storage is the reference). Completions and chat,
streaming and not, match one colocated `--role both` worker token for token (greedy); /metrics shows KV
bytes moved and TTFT observations; SIGTERM leaves no child process behind."""
from __future__ import annotations

import functools
import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import yaml
import waiting
from serving_helpers import NIXL_MISSING, metric, nixl_available

from disagg.worker.local.process import LocalProcess, ProcessSpec, free_port, is_ready

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "disagg.worker.cli"]
PROMPT = "In the morning the engineers measured the latency of every request twice and wrote it down"
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": PROMPT}]
CONNECTORS = [
    pytest.param("NixlConnector", id="nixl", marks=pytest.mark.skipif(not nixl_available(), reason=NIXL_MISSING)),
    pytest.param("SharedStorageConnector", id="shared-storage"),
]
wait_for = functools.partial(waiting.wait_for, interval=0.1)  # (probe, timeout, what); probes read logs or call HTTP


def children_of(pid: int) -> set[int]:
    kids = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            kids.add(int(stat.parent.name))
    return kids


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    port = free_port()
    argv = [*CLI, "worker", "--role", "both", "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
            "--max-model-len", "512", "--num-kv-blocks", "256", "--served-model-name", "tiny-llama"]
    proc = LocalProcess(ProcessSpec("reference", argv, f"http://127.0.0.1:{port}"), tmp_path_factory.mktemp("ref"))
    proc.start()
    yield proc
    proc.terminate()
    assert proc.popen.wait(30) == 0


@pytest.fixture(scope="module", params=CONNECTORS)
def up(request, tmp_path_factory, reference):
    tmp = tmp_path_factory.mktemp(f"up-{request.param}")
    doc = yaml.safe_load((REPO / "examples" / "local.yaml").read_text())
    doc["spec"]["kvTransfer"].update(connector=request.param, leaseSeconds=5)
    doc["spec"]["decode"]["replicas"] = 1
    spec_file = tmp / "spec.yaml"
    spec_file.write_text(yaml.safe_dump(doc))
    port, status_port = free_port(), free_port()
    out = (tmp / "up.out").open("w")
    launcher = subprocess.Popen([*CLI, "up", "-f", str(spec_file), "--port", str(port), "--status-port",
                                 str(status_port), "--log-dir", str(tmp / "logs"), "--worker-arg=--num-kv-blocks=256"],
                                stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
    text = lambda: (tmp / "up.out").read_text()  # noqa: E731
    try:
        wait_for(lambda: "serving" in text() or launcher.poll() is not None, 120, "disagg up to serve")
        assert launcher.poll() is None, text()
        wait_for(lambda: is_ready(reference.spec.url), 120, "the reference worker")
        urls = dict(re.findall(r"(\S+)\s+ready\s+(http://\S+)", text()))
        yield {"launcher": launcher, "router": f"http://127.0.0.1:{port}", "status": f"http://127.0.0.1:{status_port}",
               "urls": urls, "output": text, "reference": reference.spec.url, "connector": request.param,
               "logs": tmp / "logs"}
    finally:
        if launcher.poll() is None:
            launcher.send_signal(signal.SIGTERM)
            launcher.wait(60)
        out.close()


def generate(url: str, kind: str, stream: bool) -> str:
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    body = {"model": "tiny-llama", "max_tokens": 12, "temperature": 0, "ignore_eos": True, "stream": stream,
            **({"messages": MESSAGES} if kind == "chat" else {"prompt": PROMPT})}
    if not stream:
        r = httpx.post(url + path, json=body, timeout=60)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert r.json()["usage"]["completion_tokens"] == 12
        return choice["message"]["content"] if kind == "chat" else choice["text"]
    text = ""
    with httpx.stream("POST", url + path, json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    for chunk in map(json.loads, lines[:-1]):
        choice = chunk["choices"][0]
        text += (choice["delta"].get("content") or "") if kind == "chat" else choice["text"]
    return text


def test_startup_output_and_status(up):
    out = up["output"]()
    assert "prefill-0" in out and "decode-0" in out and f"curl -s {up['router']}/v1/completions" in out
    assert "hand-offs: signed with a key made for this run" in out
    for worker in ("prefill-0", "decode-0"):  # the run's key reached every worker: the parity below is signed P/D
        assert "hand-offs signed and checked for local/" in (up["logs"] / f"{worker}.log").read_text()
    assert httpx.get(f"{up['status']}/ready").status_code == 200
    assert httpx.get(f"{up['router']}/v1/models").json()["data"][0]["id"] == "tiny-llama"


@pytest.mark.parametrize("kind", ["completion", "chat"])
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_greedy_output_matches_one_colocated_worker(up, kind, stream):
    assert generate(up["router"], kind, stream) == generate(up["reference"], kind, False)


def test_metrics_show_kv_transfer_and_ttft(up):
    decode, prefill = up["urls"]["decode-0"], up["urls"]["prefill-0"]
    assert metric(decode, "disagg:kv_bytes_loaded_total") > 0
    if up["connector"] == "NixlConnector":
        assert metric(decode, "vllm:nixl_bytes_transferred_sum") > 0
        assert metric(decode, "vllm:nixl_xfer_time_seconds_count") > 0
    for url in (decode, prefill):
        assert metric(url, "vllm:time_to_first_token_seconds_count") >= 4
    assert metric(up["router"], 'disagg:router_hop_requests_total') >= 4


def test_sigterm_stops_everything_and_leaves_no_child(up):
    launcher = up["launcher"]
    kids = children_of(launcher.pid)
    assert len(kids) == 3, kids  # router, prefill, decode
    launcher.send_signal(signal.SIGTERM)
    assert launcher.wait(60) == 0
    assert [pid for pid in kids if alive(pid)] == []
    assert "stopped" in up["output"]()
