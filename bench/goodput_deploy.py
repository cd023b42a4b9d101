"""bench/goodput.py's deployments: P/D or colocated workers behind the router, each worker pinned to its own cores.

Commands and environment come from `disagg up`'s plan (worker/local/launcher.plan -> operator/src/plan.py), the
same argv a user's `disagg up` runs; this module only adds the pinning (taskset; torch/OpenMP threads = the cores
given; VLLM_CPU_OMP_THREADS_BIND for vLLM) and, for colocated workers, drops the KV connector (a colocated worker
has nothing to hand off: `disagg worker --role both`, `vllm serve` without --kv-transfer-config - vLLM's NIXL
progress thread would otherwise busy-poll the worker's core).
"""
from __future__ import annotations

import os
import re
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from disagg.worker.local.launcher import find_vllm, handoff_env, plan
from disagg.operator.plan import check_local
from disagg.worker.kv_transfer.connectors import all_settings
from disagg.worker.local.process import LocalProcess, free_port, shutdown, wait_all_ready

MODEL_NAME = "bench-llama"
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "2"}


@dataclass(frozen=True)
class Config:
    """One deployment at a given core count: `prefill` prefill + `decode` decode workers (P/D), or `decode`
    colocated workers (prefill 0), each on `cores_each` cores. The router (least-loaded) and the load generator
    are not pinned: every configuration shares them alike."""

    name: str
    prefill: int
    decode: int
    cores_each: int

    @property
    def pd(self) -> bool:
        return self.prefill > 0

    @property
    def cores(self) -> int:
        return (self.prefill + self.decode) * self.cores_each


def parse_config(text: str) -> Config:
    """pd:P:D (P prefill + D decode, one core each), colo:N (N colocated workers, one core each), colo1:C (one
    colocated worker on C cores)."""
    m = re.fullmatch(r"pd:(\d+):(\d+)|colo:(\d+)|colo1:(\d+)", text)
    if not m:
        raise ValueError(f"configuration {text!r}: expected pd:P:D, colo:N or colo1:C (e.g. pd:1:1 colo:2 colo1:2)")
    if m.group(1):
        p, d = int(m.group(1)), int(m.group(2))
        if p < 1 or d < 1:
            raise ValueError(f"configuration {text!r}: P/D needs at least one prefill and one decode worker")
        return Config(f"P/D {p}P+{d}D", p, d, 1)
    if m.group(3):
        return Config(f"colocated {m.group(3)}x1core", 0, int(m.group(3)), 1)
    return Config(f"colocated 1x{m.group(4)}cores", 0, 1, int(m.group(4)))


def _spec_doc(config: Config, engine: str, model_dir: str, max_model_len: int) -> dict[str, Any]:
    return {"model": {"servedName": MODEL_NAME, "dtype": "float32", "maxModelLen": max_model_len,
                      "source": {"path": model_dir}},
            "engine": engine,
            "kvTransfer": {"connector": "NixlConnector", "leaseSeconds": 30, "loadFailurePolicy": "recompute"},
            "prefill": {"replicas": config.prefill}, "decode": {"replicas": config.decode},
            "router": {"replicas": 1, "policy": "least-loaded", "service": {"port": 8000}},
            "autoscaling": {"enabled": False}}


def _colocated(argv: list[str], engine: str) -> list[str]:
    """A planned decode worker's argv as a colocated worker: no KV connector (and role both for ours)."""
    drop = {"--kv-transfer-config"} if engine == "vllm" else {
        "--kv-connector", "--kv-lease-seconds", "--kv-load-failure-policy", *(s.flag for s in all_settings())}
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in drop:
            skip = True
        else:
            out.append(a)
    if engine == "disagg":
        out[out.index("--role") + 1] = "both"
    return out


def _pinned(argv: list[str], env: dict[str, str], cores: list[int], engine: str) -> tuple[list[str], dict[str, str]]:
    cpus = ",".join(map(str, cores))
    env = {**env, "OMP_NUM_THREADS": str(len(cores)), "MKL_NUM_THREADS": str(len(cores))}
    if engine == "vllm":
        env = {**env, **VLLM_ENV, "VLLM_CPU_OMP_THREADS_BIND": cpus}
    return ["taskset", "-c", cpus, *argv], env


def _tree_cpu_s(pid: int) -> float:
    children: dict[int, list[int]] = {}
    times: dict[int, float] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(entry))  # fields[1]: ppid
        times[int(entry)] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        total += times.get(p, 0.0)
        todo += children.get(p, [])
    return total


class Deployment:
    """Router + workers of one Config, started and stopped as a whole (a context manager)."""

    def __init__(self, config: Config, engine: str, model_dir: str, log_dir: Path, *, max_model_len: int,
                 worker_args: list[str], startup_s: float):
        spec, problems = check_local(_spec_doc(config, engine, model_dir, max_model_len))
        if spec is None or problems:
            raise SystemExit("\n".join(map(str, problems)))
        log_dir.mkdir(parents=True, exist_ok=True)
        cores = sorted(os.sched_getaffinity(0))
        if config.cores > len(cores):
            raise SystemExit(f"{config.name} needs {config.cores} cores; this process may use {len(cores)}")
        used = iter(range(len(cores)))
        router_port = free_port()
        specs = plan(spec, model_dir, "127.0.0.1", router_port, free_port, str(log_dir / "kv"),
                     worker_args if engine == "disagg" else [],
                     vllm_executable=find_vllm() if engine == "vllm" else None,
                     handoff=handoff_env("goodput")).processes
        self.workers: list[LocalProcess] = []
        for s in (s for s in specs if s.role in ("prefill", "decode")):
            mine = [cores[next(used)] for _ in range(config.cores_each)]
            argv = s.argv if config.pd else _colocated(s.argv, engine)
            argv, env = _pinned(argv, s.env, mine, engine)
            self.workers.append(LocalProcess(replace(s, argv=argv, env=env), log_dir))
        # the router, and whatever else the plan starts after the workers (in its order): not pinned
        self.others = [LocalProcess(s, log_dir) for s in specs if s.role not in ("prefill", "decode")]
        self.router = next(p for p in self.others if p.spec.role == "router")
        self.config, self.startup_s = config, startup_s
        self.url = self.router.spec.url
        self.started_s = 0.0  # the workers' start-up (spawn -> all ready), for the capacity model

    def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds (user + system) each worker - its process tree - has used so far, by worker name: what a
        request costs in compute, whatever else shares the machine (wall times are not)."""
        return {w.spec.name: _tree_cpu_s(w.popen.pid) for w in self.workers if w.popen is not None}

    def urls(self, role: str) -> list[str]:
        return [w.spec.url for w in self.workers if w.spec.role == role]

    def __enter__(self) -> Deployment:
        stop, t0 = threading.Event(), time.monotonic()
        for w in self.workers:
            w.start()
        say = lambda line: None  # noqa: E731 - failures are raised below with the log's tail
        if not wait_all_ready(self.workers, t0 + self.startup_s, stop, say):
            self.__exit__()
            raise SystemExit(f"{self.config.name}: workers did not start; logs:\n" +
                             "\n".join(w.log_tail() for w in self.workers))
        self.started_s = time.monotonic() - t0
        for p in self.others:
            p.start()
            if not wait_all_ready([p], time.monotonic() + 60, stop, say):
                self.__exit__()
                raise SystemExit(f"{self.config.name}: {p.spec.name} did not start:\n{p.log_tail()}")
        return self

    def __exit__(self, *exc: Any) -> None:
        shutdown([*self.others, *self.workers], grace_s=20.0, say=lambda line: None)
