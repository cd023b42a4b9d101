"""`disagg up` scaling without a model: the router's endpoints file, the launcher's plan with file discovery, the
worker set's states (leaving -> SIGTERM -> gone) on stand-in processes, victim choice, and the autoscaling tick
against scripted samples (scale up, dry run, report)."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from disagg.operator.autoscaling import samples as ms
from disagg.operator.autoscaling.report import ScalingChange, scaling_line
from disagg.operator.autoscaling.scaling_pass import choose_removals
from disagg.operator.plan import initial_replicas
from disagg.operator.spec import parse_spec
from disagg.worker.local.launcher import plan
from disagg.worker.local.process import LocalProcess, ProcessSpec
from disagg.worker.local.scaling import DRAINING, LEAVING, SERVING, STARTING, LocalAutoscaler, WorkerSet
from disagg.worker.router.app import build_app
from disagg.worker.router.discovery import FileDiscovery, parse_endpoints, write_endpoints
from disagg.worker.router.endpoints import EndpointPool
from disagg.worker.router.metrics import RouterMetrics
from disagg.worker.router.state import RouterState

SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]


# ---------------------------------------------------------------- the endpoints file
def test_endpoints_file_is_validated_with_the_bad_value_named():
    assert parse_endpoints('{"decode": ["http://d:1"]}') == {"prefill": [], "decode": ["http://d:1"]}
    for text, words in (("[1]", "expected an object"), ('{"decode": "http://d"}', "'decode' must be a list"),
                        ("{", "not JSON")):
        with pytest.raises(ValueError, match=words):
            parse_endpoints(text, "f.json")


def test_file_discovery_applies_changes_only_and_keeps_the_last_membership_on_a_bad_file(tmp_path):
    path = tmp_path / "endpoints.json"
    prefill, decode = EndpointPool("prefill"), EndpointPool("decode")
    discovery = FileDiscovery(str(path))
    assert not discovery.poll(prefill, decode)  # no file yet
    write_endpoints(path, ["http://p:1"], ["http://d:1", "http://d:2"])
    assert discovery.poll(prefill, decode)
    assert list(decode.endpoints) == ["http://d:1", "http://d:2"] and list(prefill.endpoints) == ["http://p:1"]
    decode.endpoints["http://d:1"].ready = True
    assert not discovery.poll(prefill, decode), "unchanged file: nothing to do"
    write_endpoints(path, ["http://p:1"], ["http://d:1"])
    assert discovery.poll(prefill, decode)
    assert list(decode.endpoints) == ["http://d:1"] and decode.endpoints["http://d:1"].ready, "state is kept"
    path.write_text("{broken")
    assert not discovery.poll(prefill, decode)
    assert list(decode.endpoints) == ["http://d:1"]
    assert [p.name for p in tmp_path.iterdir()] == ["endpoints.json"], "no temporary file left behind"


def test_a_missing_or_bad_endpoints_file_is_logged_once_per_problem(tmp_path, caplog):
    """A router started before its launcher wrote the file polls every second: one warning, not one a second."""
    path = tmp_path / "endpoints.json"
    prefill, decode = EndpointPool("prefill"), EndpointPool("decode")
    discovery = FileDiscovery(str(path))
    with caplog.at_level("WARNING", logger="disagg.worker.router.discovery"):
        for _ in range(5):
            discovery.poll(prefill, decode)
        path.write_text("{broken")
        for _ in range(3):
            discovery.poll(prefill, decode)
        write_endpoints(path, ["http://p:1"], ["http://d:1"])
        assert discovery.poll(prefill, decode)
        path.write_text("{broken again")
        discovery.poll(prefill, decode)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 3, warnings  # missing, broken, broken again after a good read
    assert "No such file" in warnings[0] and "not JSON" in warnings[1] and "keeping 1 prefill, 1 decode" in warnings[2]


@pytest.mark.asyncio
async def test_router_lists_its_membership_at_endpoints():
    prefill, decode = EndpointPool("prefill"), EndpointPool("decode")
    prefill.set_urls(["http://p:1"])
    decode.set_urls(["http://d:1"])
    decode.endpoints["http://d:1"].outstanding = 3
    decode.endpoints["http://d:1"].reported_load, decode.endpoints["http://d:1"].kv_usage = 5.0, 0.25
    client = httpx.AsyncClient(transport=httpx.ASGITransport(build_app(RouterState(prefill, decode, RouterMetrics()))),
                               base_url="http://router")
    body = (await client.get("/endpoints")).json()
    idle = {"ejected": False, "ejections": 0}
    assert body == {"prefill": [{"url": "http://p:1", "ready": False, "outstanding": 0, "load": 0.0, "kv_usage": 0.0,
                                 **idle}],
                    "decode": [{"url": "http://d:1", "ready": False, "outstanding": 3, "load": 5.0, "kv_usage": 0.25,
                                **idle}]}


@pytest.mark.asyncio
async def test_round_robin_router_shows_no_kv_usage_it_never_scraped():
    prefill, decode = EndpointPool("prefill", "round-robin"), EndpointPool("decode", "round-robin")
    prefill.set_urls(["http://p:1"])
    decode.set_urls(["http://d:1"])
    decode.endpoints["http://d:1"].outstanding = 2
    client = httpx.AsyncClient(transport=httpx.ASGITransport(build_app(RouterState(prefill, decode, RouterMetrics()))),
                               base_url="http://router")
    [d] = (await client.get("/endpoints")).json()["decode"]
    assert d["load"] == 2.0 and d["kv_usage"] is None


# ---------------------------------------------------------------- the plan
SCALED = {"model": {"servedName": "tiny"}, "prefill": {"replicas": 1}, "decode": {"replicas": 5},
          "autoscaling": {"enabled": True, "decode": {"minReplicas": 1, "maxReplicas": 2}}}


def test_plan_with_an_endpoints_file_starts_replicas_inside_the_autoscaling_bounds():
    ports = iter(range(9000, 9100))
    procs = plan(parse_spec(SCALED), "/ckpt", "127.0.0.1", 8000, lambda: next(ports), "/kv",
                 endpoints_file="/logs/endpoints.json").processes
    assert [(p.name, p.role) for p in procs] == [("prefill-0", "prefill"), ("decode-0", "decode"),
                                                 ("decode-1", "decode"), ("router", "router")]
    router = procs[-1].argv
    assert router[router.index("--discovery") + 1] == "file" and "--decode" not in router
    assert router[router.index("--endpoints-file") + 1] == "/logs/endpoints.json"
    off = parse_spec({**SCALED, "autoscaling": {"enabled": False}})
    assert initial_replicas(off, "decode") == 5, "without autoscaling replicas is taken as is"


# ---------------------------------------------------------------- the worker set
def worker_set(tmp_path, **kw) -> tuple[WorkerSet, list[str]]:
    said: list[str] = []
    new = lambda role, i: ProcessSpec(f"{role}-{i}", SLEEPER, f"http://127.0.0.1:1/{role}-{i}", role=role)  # noqa
    return WorkerSet(new, tmp_path, tmp_path / "endpoints.json", "http://127.0.0.1:1", said.append, **kw), said


def endpoints(tmp_path) -> dict:
    return json.loads((tmp_path / "endpoints.json").read_text())


def test_a_retired_worker_leaves_the_endpoints_file_before_it_gets_sigterm_and_then_goes(tmp_path):
    workers, said = worker_set(tmp_path, leave_timeout_s=0.3)
    try:
        first = workers.add("decode")
        second = workers.add("decode")
        assert [p.spec.name for p in workers.workers] == ["decode-0", "decode-1"]
        assert endpoints(tmp_path)["decode"] == [first.spec.url, second.spec.url]
        assert workers.counts() == {"prefill": 0, "decode": 2} and first.state == STARTING
        first.state = SERVING
        busy = [ms.PodSample("decode-0", "decode", 0.0, {ms.NUM_REQUESTS_RUNNING: 3.0})]  # decode-1 not scraped yet
        assert workers.newest_first("decode") == ["decode-1", "decode-0"]
        chosen = choose_removals(workers.newest_first("decode"), busy, 1)
        assert workers.retire("decode", chosen) == [second], "starting goes first"
        assert second.state == LEAVING and endpoints(tmp_path)["decode"] == [first.spec.url]
        workers.step()
        assert second.state == LEAVING and second.exited() is None, "the router may still list it"
        time.sleep(0.4)
        workers.step()
        assert second.state == DRAINING
        second.popen.wait(10)
        workers.step()
        assert workers.workers == [first] and workers.counts()["decode"] == 1
        assert any("decode-1" in line and "stopped" in line for line in said), said
        third = workers.add("decode")
        assert third.spec.name == "decode-1", "the lowest free index is reused"
    finally:
        for p in workers.workers:
            p.kill()


def test_an_active_worker_that_dies_is_restarted(tmp_path):
    workers, said = worker_set(tmp_path)
    try:
        p = workers.add("prefill")
        p.kill()
        workers.step()
        assert p.exited() is None and p.state == STARTING
        assert any("restarting" in line for line in said)
    finally:
        p.kill()


def test_victims_are_starting_workers_then_the_least_loaded_then_the_newest(tmp_path):
    workers, _ = worker_set(tmp_path)
    for i, state in enumerate((SERVING, SERVING, SERVING, STARTING)):
        p = LocalProcess(ProcessSpec(f"decode-{i}", [], "", role="decode"), tmp_path)
        workers.workers.append(p)
        p.state = state
    running = {"decode-0": 1.0, "decode-1": 5.0, "decode-2": 1.0}  # decode-3 is starting: not scraped
    scraped = [ms.PodSample(name, "decode", 0.0, {ms.NUM_REQUESTS_RUNNING: n}) for name, n in running.items()]
    assert choose_removals(workers.newest_first("decode"), scraped, 3) == ["decode-3", "decode-2", "decode-0"]
    assert choose_removals(workers.newest_first("decode"), scraped, 0) == []
    sample = ms.PodSample("decode-0", "decode", 0.0, {ms.NUM_REQUESTS_RUNNING: 2, ms.NUM_REQUESTS_WAITING: 1,
                                                      ms.PENDING_LOADS: 1, ms.KV_CACHE_USAGE: 0.5})
    assert ms.pod_load(sample) == 4


# ---------------------------------------------------------------- the autoscaling tick
class FakeWorkers:
    def __init__(self, counts: dict[str, int]):
        self._counts = dict(counts)
        self.calls: list[tuple] = []
        self.procs = [SimpleNamespace(spec=SimpleNamespace(name=f"{r}-{i}", role=r))
                      for r, n in counts.items() for i in range(n)]

    def serving(self):
        return self.procs

    def counts(self):
        return dict(self._counts)

    def newest_first(self, role):
        return [p.spec.name for p in reversed(self.procs) if p.spec.role == role]

    def add(self, role):
        self.calls.append(("add", role))

    def retire(self, role, names):
        self.calls.append(("retire", role, names))


def samples(kv_usage: float, running: float, now: float):
    def scrape(procs):
        return [ms.PodSample(p.spec.name, p.spec.role, now, {ms.KV_CACHE_USAGE: kv_usage, ms.NUM_REQUESTS_WAITING: 0,
                                                             ms.NUM_REQUESTS_RUNNING: running}) for p in procs]
    return scrape


AUTOSCALING = {"enabled": True, "intervalSeconds": 2, "prefill": {"minReplicas": 1, "maxReplicas": 1},
               "decode": {"minReplicas": 1, "maxReplicas": 2}, "targets": {"decode": {"kvCacheUsagePercent": 20}},
               "stabilization": {"scaleUpSeconds": 0, "scaleDownSeconds": 4}}


def autoscaler(workers, scrape, now, dry_run=False):
    spec = parse_spec({"model": {"servedName": "tiny"}, "autoscaling": {**AUTOSCALING, "dryRun": dry_run}})
    said: list[str] = []
    return LocalAutoscaler(spec.autoscaling, workers, said.append, clock=lambda: now[0], scrape=scrape), said


def test_tick_adds_a_decode_worker_under_load_and_retires_the_least_loaded_after_the_window():
    now = [1000.0]
    workers = FakeWorkers({"prefill": 1, "decode": 1})
    scaler, said = autoscaler(workers, samples(0.5, 6, now[0]), now)
    # STEP 1: KV usage 50% against a 20% target -> decode 1 -> 2 at once (no scale-up window)
    decision = scaler.tick()
    assert decision.desired == {"prefill": 1, "decode": 2} and workers.calls == [("add", "decode")]
    assert scaler.events[-1]["from"] == 1 and scaler.events[-1]["to"] == 2
    assert scaler.events[-1]["reason"] == "DecodeBound" and scaler.events[-1]["metrics"]["decode_kv_cache_usage"] == 0.5
    assert "decode 1 -> 2 (DecodeBound)" in said[-1] and "decode_kv_cache_usage=0.5" in said[-1]
    status = scaler.status()
    assert status["lastDecision"]["roles"]["decode"]["desired"] == 2 and status["lastDecision"]["time"].endswith("Z")
    json.dumps(status)
    # STEP 2: idle at 2 decode workers: the scale-down window (4 s) holds it
    workers._counts["decode"], workers.procs = 2, workers.procs + [SimpleNamespace(
        spec=SimpleNamespace(name="decode-1", role="decode"))]
    workers.calls.clear()
    now[0] += 2
    scaler.scrape = samples(0.0, 0, now[0])
    assert scaler.tick().roles["decode"].reason == "ScaleDownStabilizing" and workers.calls == []
    # STEP 3: past the window: one goes, chosen by load
    now[0] += 6
    scaler.scrape = samples(0.0, 0, now[0])
    assert scaler.tick().desired["decode"] == 1
    assert workers.calls == [("retire", "decode", ["decode-1"])]  # both idle: the newest goes


def test_a_decode_scale_up_from_kv_waiting_at_prefill_reports_that_signal():
    now = [1000.0]
    workers = FakeWorkers({"prefill": 1, "decode": 1})

    def scrape(procs):  # decode's cache is nearly empty, but 6 prompts' KV waits at prefill to be pulled
        return [ms.PodSample(p.spec.name, p.spec.role, now[0],
                             {ms.KV_CACHE_USAGE: 0.05, ms.NUM_REQUESTS_WAITING: 0, ms.NUM_REQUESTS_RUNNING: 1,
                              ms.PENDING_SENDS: 6 if p.spec.role == "prefill" else 0}) for p in procs]
    scaler, said = autoscaler(workers, scrape, now)
    assert scaler.tick().desired["decode"] == 2 and workers.calls == [("add", "decode")]
    event = scaler.events[-1]
    assert event["reason"] == "DecodeBound" and event["metrics"]["prefill_pending_sends_per_pod"] == 6
    assert event["metrics"]["expired_leases"] == 0, "the other KV back-pressure signal is reported too"
    assert "prefill_waiting_requests_per_pod" not in event["metrics"], "prefill's own numbers stay on its events"
    assert "prefill_pending_sends_per_pod=6" in said[-1]


def test_dry_run_reports_the_decision_and_changes_nothing():
    now = [1000.0]
    workers = FakeWorkers({"prefill": 1, "decode": 1})
    scaler, said = autoscaler(workers, samples(0.9, 8, now[0]), now, dry_run=True)
    assert scaler.tick().desired["decode"] == 2
    assert workers.calls == [] and "(dry run)" in said[-1] and scaler.status()["dryRun"]
    now[0] += 2
    scaler.scrape = samples(0.9, 8, now[0])
    assert scaler.tick().desired["decode"] == 2
    assert len(said) == 1 and len(scaler.events) == 1, "the same would-be change is reported once"


def test_missing_metrics_hold():
    now = [1000.0]
    workers = FakeWorkers({"prefill": 1, "decode": 1})
    failed = lambda procs: [ms.PodSample(p.spec.name, p.spec.role, now[0], error="ConnectError") for p in procs]  # noqa
    scaler, said = autoscaler(workers, failed, now)
    assert scaler.tick().reason == "MetricsMissing" and workers.calls == [] and said == []
    assert scaling_line(ScalingChange("decode", 2, 1, "Underutilized", False, 0.0)) == \
        "[1970-01-01T00:00:00Z] autoscale: decode 2 -> 1 (Underutilized) "


# ---------------------------------------------------------------- leftovers of a stopped process
# an engine that starts a child deaf to SIGTERM (as vLLM's engine core is while it loads), writes the child's pid
# to the file named by its argument, and is deaf to SIGTERM too (--deaf) or not
ORPHANING = """
import signal, subprocess, sys, time
if "--deaf" in sys.argv:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = subprocess.Popen([sys.executable, "-c",
                          "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(120)"])
with open(sys.argv[1] + ".tmp", "w") as f:
    f.write(str(child.pid))
import os; os.rename(sys.argv[1] + ".tmp", sys.argv[1])
time.sleep(120)
"""


def _orphaning(tmp_path: Path, *flags: str) -> tuple[list[str], Path]:
    script, pid_file = tmp_path / "engine.py", tmp_path / "child.pid"
    script.write_text(ORPHANING)
    return [sys.executable, str(script), str(pid_file), *flags], pid_file


def _child_pid(pid_file) -> int:
    deadline = time.monotonic() + 30
    while not pid_file.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return int(pid_file.read_text())


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _gone(pid: int, within_s: float = 5.0) -> bool:
    deadline = time.monotonic() + within_s
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not _alive(pid)


def test_a_stopped_worker_leaves_no_process_of_its_group_behind(tmp_path):
    """`disagg up` stops a worker whose engine is still loading: what that engine started dies with it."""
    argv, pid_file = _orphaning(tmp_path)
    p = LocalProcess(ProcessSpec("decode-0", argv, "http://127.0.0.1:1", role="decode"), tmp_path)
    p.start()
    child = _child_pid(pid_file)
    p.terminate()
    p.popen.wait(10)
    assert _alive(child)  # the leader is gone, its child is not: an orphan until the exit is seen
    assert p.exited() is not None
    assert _gone(child)


def test_pd_proxy_kills_what_its_engine_left_when_it_stops(tmp_path):
    """The engine ignores SIGTERM (vLLM mid-load): pd-proxy kills it at its bound, and its engine core too."""
    from disagg.worker.router import pd_proxy

    argv, pid_file = _orphaning(tmp_path, "--deaf")
    with pd_proxy._engine_child(argv, SimpleNamespace(should_exit=False), drain_s=-9.5) as engine:  # bound 0.5 s
        child = _child_pid(pid_file)
        assert engine.poll() is None and _alive(child)
    assert engine.poll() is not None
    assert _gone(child)
