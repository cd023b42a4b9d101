"""`disagg up` with spec.autoscaling on: the operator's policy acting on local processes. Streaming load through
the router fills decode's KV cache past its target, so the launcher adds a decode worker (which then serves);
with the load gone (a trickle of short requests keeps flowing) it retires one after the scale-down window. Every
request completes (finish_reason length) across both changes; SIGTERM leaves no child behind."""
from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml
from serving_helpers import metric, nixl_available

from disagg.worker.local.process import free_port
from test_disagg_up import CLI, REPO, alive, children_of, wait_for

pytestmark = pytest.mark.slow

PROMPT = "The quick brown fox jumps over the lazy dog"
SPEC = {
    "apiVersion": "disagg.dev/v1alpha1", "kind": "DisaggregatedInference", "metadata": {"name": "autoscale"},
    "spec": {
        "model": {"servedName": "tiny-llama", "dtype": "float32", "maxModelLen": 512},
        "kvTransfer": {"connector": "NixlConnector" if nixl_available() else "SharedStorageConnector",
                       "leaseSeconds": 5},
        "prefill": {"replicas": 1},
        # 64 blocks x 16 tokens: 8 streams of 96 tokens hold ~60% of decode's KV cache, one short request ~3%
        "decode": {"replicas": 1, "extraArgs": ["--num-kv-blocks", "64"]},
        "router": {"policy": "least-loaded"},
        "autoscaling": {
            "enabled": True, "intervalSeconds": 2,
            "prefill": {"minReplicas": 1, "maxReplicas": 1}, "decode": {"minReplicas": 1, "maxReplicas": 2},
            "targets": {"decode": {"kvCacheUsagePercent": 20}},
            "stabilization": {"scaleUpSeconds": 0, "scaleDownSeconds": 6},
        },
    },
}


class Load:
    """`clients` threads, each streaming one completion after another until stopped; records every outcome."""

    def __init__(self, router: str, clients: int, max_tokens: int):
        self.router, self.max_tokens = router, max_tokens
        self.stop = threading.Event()
        self.outcomes: list[tuple[int, str | None]] = []  # (HTTP status, last finish_reason)
        self.threads = [threading.Thread(target=self._client, daemon=True) for _ in range(clients)]
        for t in self.threads:
            t.start()

    def _client(self) -> None:
        body = {"model": "tiny-llama", "prompt": PROMPT, "max_tokens": self.max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True}
        while not self.stop.is_set():
            finish = None
            try:
                with httpx.stream("POST", f"{self.router}/v1/completions", json=body, timeout=120) as r:
                    for line in r.iter_lines():
                        if line.startswith("data: {"):
                            chunk = json.loads(line[len("data: "):])
                            finish = (chunk.get("choices") or [{}])[0].get("finish_reason") or finish
                self.outcomes.append((r.status_code, finish))
            except httpx.HTTPError as e:
                self.outcomes.append((0, f"{type(e).__name__}: {e}"))

    def finish(self) -> list[tuple[int, str | None]]:
        self.stop.set()
        for t in self.threads:
            t.join(150)
        return self.outcomes


@dataclass
class Up:
    launcher: subprocess.Popen
    router: str
    status_url: str
    text: Callable[[], str]  # its console output so far

    def status(self) -> dict:
        return httpx.get(f"{self.status_url}/status", timeout=5).json()


@contextlib.contextmanager
def disagg_up(tmp_path: Path, spec: dict) -> Iterator[Up]:
    """`disagg up -f spec` serving (its console in up.out, logs under logs/); SIGTERM'd at the end if still up."""
    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text(yaml.safe_dump(spec))
    port, status_port = free_port(), free_port()
    out_path = tmp_path / "up.out"
    out = out_path.open("w")
    launcher = subprocess.Popen([*CLI, "up", "-f", str(spec_file), "--port", str(port), "--status-port",
                                 str(status_port), "--log-dir", str(tmp_path / "logs")],
                                stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
    up = Up(launcher, f"http://127.0.0.1:{port}", f"http://127.0.0.1:{status_port}", out_path.read_text)
    try:
        wait_for(lambda: "serving" in up.text() or launcher.poll() is not None, 120, "disagg up to serve")
        assert launcher.poll() is None, up.text()
        yield up
    finally:
        if launcher.poll() is None:
            launcher.send_signal(signal.SIGTERM)
            launcher.wait(60)
        out.close()


def test_load_adds_a_decode_worker_and_idle_retires_it_without_failing_a_request(tmp_path):
    loads: list[Load] = []
    with disagg_up(tmp_path, SPEC) as up:
        _scale_up_and_down(up, tmp_path, loads)


def _scale_up_and_down(up: Up, tmp_path: Path, loads: list[Load]) -> None:
    launcher, router, text, get_status = up.launcher, up.router, up.text, up.status
    try:
        assert get_status()["replicas"] == {"prefill": 1, "decode": 1}
        t0 = time.monotonic()

        # STEP 1: load -> DecodeBound -> a second decode worker, which then takes requests
        loads.append(Load(router, clients=8, max_tokens=96))
        wait_for(lambda: get_status()["replicas"]["decode"] == 2, 45, f"a second decode worker\n{text()}")
        t_up = time.monotonic() - t0
        up = get_status()["autoscaling"]["events"][-1]
        assert (up["role"], up["from"], up["to"], up["reason"]) == ("decode", 1, 2, "DecodeBound"), up
        # decode is short: its KV cache is over the 20% target, or (on a slow box, before decode admits
        # the streams) their KV waits at prefill to be pulled - over the default 2 pending sends per pod, or
        # left unpulled until a lease ran out
        m = up["metrics"]
        assert (m["decode_kv_cache_usage"] > 0.2 or m["prefill_pending_sends_per_pod"] > 2
                or m["expired_leases"] > 0), m
        assert "autoscale: decode 1 -> 2 (DecodeBound)" in text()
        added = wait_for(lambda: next((w for w in get_status()["workers"] if w["name"] == "decode-1"
                                       and w["state"] == "serving"), None), 60, f"decode-1 serving\n{text()}")
        wait_for(lambda: metric(added["url"], "vllm:generation_tokens_total") > 0, 30, "decode-1 to generate")
        t_serving = time.monotonic() - t0

        # STEP 2: only a trickle of short requests: under the target, so after the 6 s window one worker leaves
        heavy = loads[0].finish()
        loads.append(Load(router, clients=1, max_tokens=8))
        t1 = time.monotonic()
        wait_for(lambda: get_status()["replicas"]["decode"] == 1, 45, f"scale-down to 1 decode\n{text()}")
        wait_for(lambda: len(get_status()["workers"]) == 2, 60, f"the retired worker to drain\n{text()}")
        t_down = time.monotonic() - t1
        time.sleep(1)  # the trickle keeps going against the smaller set
        trickle = loads[1].finish()
        down = get_status()["autoscaling"]["events"][-1]
        assert (down["role"], down["from"], down["to"], down["reason"]) == ("decode", 2, 1, "Underutilized"), down
        assert "autoscale: decode 2 -> 1 (Underutilized)" in text()
        assert text().index(" leaving ") < text().index("(drained, exit status 0)"), text()
        endpoints = json.loads((tmp_path / "logs" / "endpoints.json").read_text())
        assert len(endpoints["decode"]) == 1 and len(endpoints["prefill"]) == 1

        # no request failed or was cut short, under load, while scaling up, or while scaling down
        assert heavy and trickle, (heavy, trickle)
        assert {o for o in heavy + trickle} == {(200, "length")}, [o for o in heavy + trickle if o != (200, "length")]
        print(f"\nscale-up after {t_up:.1f}s of load, decode-1 serving after {t_serving:.1f}s; scale-down "
              f"{t_down:.1f}s after the load stopped; {len(heavy)} long + {len(trickle)} short requests ok")

        # STEP 3: SIGTERM stops everything
        kids = children_of(launcher.pid)
        assert len(kids) == 3, kids  # router, prefill-0, decode-0
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(60) == 0
        assert [pid for pid in kids if alive(pid)] == []
    finally:
        for load in loads:
            load.stop.set()


def test_spec_file_written_by_this_test_is_valid_for_the_launcher(tmp_path):
    from disagg.worker.local.launcher import load_spec

    path = Path(tmp_path / "spec.yaml")
    path.write_text(yaml.safe_dump(SPEC))
    name, spec = load_spec(str(path))
    assert name == "autoscale" and spec.autoscaling.enabled
