"""The fault tier's machinery: real worker processes that a test freezes (SIGSTOP), thaws, kills (SIGKILL) or cuts
off, optionally in their own network namespaces joined by a veth pair, and checks that read every worker's state
from /metrics. Generic: nothing here knows about KV transfer or routing, so every fault test builds on it.

- `fault_fleet`: starts `disagg worker` / `disagg router` processes (optionally inside a namespace), stops them
  all at the end (thawing frozen ones first), and returns their exit codes.
- `netns_pair`: two fresh network namespaces joined by a veth pair on a private /30 (no other interface, so no
  traffic can leave them); link down/up and qdiscs (tc) on the link. Skips the test with the reason when
  namespaces cannot be created here.
- `Worker.http`: an httpx client whose sockets live in the worker's namespace (created by a thread that entered
  it with setns(2)), so the test process itself never needs an address outside loopback.
"""
from __future__ import annotations

import concurrent.futures
import ctypes
import itertools
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import httpx
import pytest

from disagg.worker.local.process import LocalProcess, ProcessSpec, free_port

CLI = [sys.executable, "-m", "disagg.worker.cli"]
CLONE_NEWNET = 0x40000000
_names = itertools.count()


class NetnsClient:
    """Runs HTTP calls on one thread that entered network namespace `netns` (None: this process's own)."""

    def __init__(self, netns: str | None):
        self.netns = netns
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"http-{netns or 'host'}",
                                                           initializer=self._enter)
        self._client: httpx.Client | None = None

    def _enter(self) -> None:
        if self.netns is not None:  # setns(2) on this thread only; sockets it makes stay in the namespace
            fd = os.open(f"/run/netns/{self.netns}", os.O_RDONLY)
            try:
                if ctypes.CDLL("libc.so.6", use_errno=True).setns(fd, CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), f"setns into {self.netns} failed")
            finally:
                os.close(fd)
        self._client = httpx.Client(timeout=30)

    def submit(self, method: str, url: str, **kw: Any) -> concurrent.futures.Future:
        return self._pool.submit(lambda: self._client.request(method, url, **kw))

    def request(self, method: str, url: str, **kw: Any) -> httpx.Response:
        return self.submit(method, url, **kw).result()

    def close(self) -> None:
        if self._client is not None:
            self._pool.submit(self._client.close).result()
        self._pool.shutdown(wait=False)


@dataclass
class Worker:
    name: str
    url: str  # http://127.0.0.1:port inside its namespace
    proc: LocalProcess
    http: NetnsClient
    netns: str | None = None
    frozen: bool = False
    side_channel_host: str = "127.0.0.1"

    @property
    def pid(self) -> int:
        return self.proc.popen.pid

    def freeze(self) -> None:
        os.kill(self.pid, signal.SIGSTOP)
        self.frozen = True

    def thaw(self) -> None:
        if self.frozen and self.proc.exited() is None:
            os.kill(self.pid, signal.SIGCONT)
        self.frozen = False

    def kill(self) -> None:
        os.kill(self.pid, signal.SIGKILL)
        self.proc.popen.wait(10)
        self.frozen = False

    def post(self, path: str, body: dict, timeout: float = 60) -> httpx.Response:
        try:
            return self.http.request("POST", self.url + path, json=body, timeout=timeout)
        except httpx.TimeoutException as e:  # name the worker and show what it was doing
            raise AssertionError(f"{self.name}: no answer to {path} within {timeout}s ({e}):\n"
                                 f"{self.proc.log_tail(30)}") from e

    def post_async(self, path: str, body: dict, timeout: float = 60) -> concurrent.futures.Future:
        return self.http.submit("POST", self.url + path, json=body, timeout=timeout)

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics, labels dropped (each metric here carries one label set), summed by name."""
        text = self.http.request("GET", self.url + "/metrics", timeout=5).text
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.split("{", 1)[0].split(" ", 1)[0], float(line.rsplit(" ", 1)[1])
                out[name] = out.get(name, 0.0) + value
        return out

    def ready(self) -> bool:
        try:
            return self.http.request("GET", self.url + "/ready", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False


# what "idle" reads on a worker's /metrics: nothing running or waiting, no KV held for or awaited from a peer
IDLE = {"vllm:num_requests_running": 0.0, "vllm:num_requests_waiting": 0.0, "disagg:kv_pending_sends": 0.0,
        "disagg:kv_pending_loads": 0.0, "vllm:kv_cache_usage_perc": 0.0}


def wait_idle(workers: list[Worker], timeout: float) -> None:
    """Poll every worker's /metrics until all read IDLE; fail naming what is still held after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        held = {w.name: {k: v for k, v in w.metrics().items() if k in IDLE and v != IDLE[k]} for w in workers}
        if not any(held.values()):
            return
        assert time.monotonic() < deadline, f"not idle after {timeout}s: {held}"
        time.sleep(0.2)


class FaultFleet:
    def __init__(self, log_dir: Path):
        self.log_dir = log_dir
        self.workers: list[Worker] = []

    def worker(self, role: str, args: list[str], *, netns: str | None = None, env: dict[str, str] | None = None,
               side_channel_host: str = "127.0.0.1", name: str | None = None) -> Worker:
        """Start `disagg worker --role ROLE --host 127.0.0.1 --port P ARGS` (inside `netns` when given)."""
        name = name or f"{role}-{next(_names)}"
        port = free_port()
        argv = [*CLI, "worker", "--role", role, "--host", "127.0.0.1", "--port", str(port), *args]
        if netns is not None:
            argv = ["ip", "netns", "exec", netns, *argv]  # execs the worker: the pid is the worker's own
        proc = LocalProcess(ProcessSpec(name, argv, f"http://127.0.0.1:{port}", env=env or {}), self.log_dir)
        proc.start()
        worker = Worker(name, proc.spec.url, proc, NetnsClient(netns), netns, side_channel_host=side_channel_host)
        self.workers.append(worker)
        return worker

    def wait_ready(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        for w in self.workers:
            while not w.ready():
                assert w.proc.exited() is None, f"{w.name} exited early:\n{w.proc.log_tail(40)}"
                assert time.monotonic() < deadline, f"{w.name} not ready after {timeout}s:\n{w.proc.log_tail(20)}"
                time.sleep(0.2)

    def remove(self, worker: Worker) -> None:
        worker.http.close()
        self.workers.remove(worker)

    def stop(self, timeout: float = 30.0) -> dict[str, int]:
        for w in self.workers:
            w.thaw()
            if w.proc.exited() is None:
                w.proc.terminate()
        codes = {}
        for w in self.workers:
            try:
                codes[w.name] = w.proc.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                w.proc.kill()
                codes[w.name] = -9
            w.http.close()
        return codes


@pytest.fixture(scope="module")
def fault_fleet(tmp_path_factory) -> Any:
    fleet = FaultFleet(tmp_path_factory.mktemp("faults"))
    yield fleet
    codes = fleet.stop()
    assert all(c == 0 for c in codes.values()), f"workers did not exit cleanly: {codes}"


@pytest.fixture
def wait_idle_all(fault_fleet) -> Callable[..., None]:
    """wait_idle_all(timeout=30): every worker of the fleet reads idle on /metrics (see IDLE)."""
    return lambda timeout=30.0: wait_idle(fault_fleet.workers, timeout)


@dataclass
class NetnsPair:
    """Namespaces a and b, veth ends dev_a (addr_a) and dev_b (addr_b) on a private /30."""

    a: str
    b: str
    dev_a: str
    dev_b: str
    addr_a: str
    addr_b: str
    _qdiscs: list[str] = field(default_factory=list)

    def ip(self, *args: str) -> None:
        _run("ip", *args)

    def link(self, up: bool) -> None:
        state = "up" if up else "down"
        self.ip("-n", self.a, "link", "set", self.dev_a, state)
        self.ip("-n", self.b, "link", "set", self.dev_b, state)

    def qdisc(self, *spec: str) -> None:
        """`tc qdisc replace dev DEV root SPEC` on both ends (e.g. "tbf rate 2mbit ..."); skips the calling
        test, naming the qdisc and tc's answer, when this kernel lacks it."""
        for ns, dev in ((self.a, self.dev_a), (self.b, self.dev_b)):
            r = subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root", *spec],
                               capture_output=True, text=True)
            if r.returncode != 0:
                self.clear_qdisc()
                pytest.skip(f"tc qdisc {spec[0]} cannot be set here: {r.stderr.strip()} "
                            f"(the kernel has no sch_{spec[0]})")

    def clear_qdisc(self) -> None:
        for ns, dev in ((self.a, self.dev_a), (self.b, self.dev_b)):
            subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root"],
                           capture_output=True)


def _run(*argv: str) -> None:
    r = subprocess.run(argv, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {r.stderr.strip()}")


def create_netns_pair(tag: str) -> NetnsPair:
    """Two namespaces joined by veth on 10.213.<n>.0/30 (private; only these two ends hold addresses)."""
    n = os.getpid() % 250 + 1
    pair = NetnsPair(f"fk{tag}a{os.getpid()}", f"fk{tag}b{os.getpid()}", f"fk{tag}a", f"fk{tag}b",
                     f"10.213.{n}.1", f"10.213.{n}.2")
    try:
        for ns in (pair.a, pair.b):
            _run("ip", "netns", "add", ns)
            _run("ip", "-n", ns, "link", "set", "lo", "up")
        _run("ip", "-n", pair.a, "link", "add", pair.dev_a, "type", "veth", "peer", "name", pair.dev_b,
             "netns", pair.b)
        _run("ip", "-n", pair.a, "addr", "add", f"{pair.addr_a}/30", "dev", pair.dev_a)
        _run("ip", "-n", pair.b, "addr", "add", f"{pair.addr_b}/30", "dev", pair.dev_b)
        pair.link(up=True)
    except (RuntimeError, FileNotFoundError):
        delete_netns_pair(pair)
        raise
    return pair


def delete_netns_pair(pair: NetnsPair) -> None:
    for ns in (pair.a, pair.b):  # deleting a namespace deletes the veth end in it (and so both ends)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


@pytest.fixture(scope="module")
def netns_pair(request) -> Any:
    tag = "".join(c for c in request.module.__name__.rsplit(".", 1)[-1] if c.isalnum())[-3:]
    try:
        pair = create_netns_pair(tag)
    except (RuntimeError, FileNotFoundError) as e:
        case = (request.module.__doc__ or request.module.__name__).strip().split("\n")[0]
        pytest.skip(f"{request.module.__name__} ({case}) skipped: network namespaces cannot be created here ({e}); "
                    f"it needs root (CAP_NET_ADMIN), as in CI")
    yield pair
    delete_netns_pair(pair)


@dataclass
class FaultOutcome:
    case: str  # "prefill SIGSTOP / during READ"
    outcome: str  # "200, healthy tokens" | "500: <message>"
    seconds: float  # from the request that met the fault to its outcome
    bound_s: float  # the documented bound it had to meet


_OUTCOMES: list[FaultOutcome] = []


@pytest.fixture
def record_outcome() -> Callable[..., None]:
    """record_outcome(case, outcome, seconds, bound_s): a row of the table printed at the end of the run."""
    return lambda *a: _OUTCOMES.append(FaultOutcome(*a))


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not _OUTCOMES:
        return
    terminalreporter.section("faults: outcome and time to outcome")
    for o in _OUTCOMES:
        terminalreporter.write_line(f"{o.case:<48} {o.outcome:<44} {o.seconds:6.2f}s (bound {o.bound_s:g}s)")
