"""The operator (`disagg operator`, a process) killed with SIGKILL between its writes - after the RBAC and Services
but before any Deployment, or after every child but before the status - then started again: the next operator
converges. Children written before the kill are kept (same uid) and not created again, none is missing, status is
complete. The kill point is held by answering that one write 503 until the kill."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from waiting import wait_for

from ctl_fixtures import api_fixture, example_fixture  # noqa: F401 (fixtures api, example)
from operator_harness import RESYNC_SECONDS
from test_operator import NAME, NS, all_children, children_created, cond_is, cr, create, play_controller

STATUS_PATH = f"/disaggregatedinferences/{NAME}/status"
CONVERGE_S = 60.0  # a new process: imports, login, the first pass


def start_operator(log: object) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "disagg.worker.cli", "operator", "--namespace", NS,
                             "--resync-seconds", str(RESYNC_SECONDS), "--log-level", "WARNING"],
                            env=dict(os.environ), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(10)


def attempts(server, method: str, fragment: str) -> int:
    return sum(1 for r in server.emulator.requests if r.method == method and fragment in r.path)


def children(server) -> dict[tuple, str]:
    return {(res, o["metadata"]["name"]): o["metadata"]["uid"] for res, objs in all_children(server).items()
            for o in objs}


@pytest.mark.parametrize("method, fragment", [("POST", "/deployments"), ("PATCH", STATUS_PATH)],
                         ids=["before-deployments", "before-status"])
def test_operator_killed_between_writes_then_restarted_converges(api, example, tmp_path, method, fragment):
    server, _ = api
    server.emulator.inject_failure(method, fragment, 503, times=10**6)
    log = open(tmp_path / "operator.log", "w")
    first = start_operator(log)
    second = None
    try:
        create(server, example)
        wait_for(lambda: attempts(server, method, fragment) >= 2 or first.poll() is not None, CONVERGE_S,
                 f"the operator retrying {method} {fragment}")
        kill(first)
        written = children(server)
        if method == "POST":
            assert written and not children_created(server), "killed with some children written, not all"
        else:
            assert children_created(server), "every child written, only the status left"
        assert not (cr(server).get("status") or {}).get("conditions"), "no status written before the kill"
        server.emulator.failures.clear()
        since = len(server.emulator.requests)
        started = time.monotonic()
        second = start_operator(log)
        wait_for(lambda: children_created(server) and (cr(server).get("status") or {}).get("conditions"),
                 CONVERGE_S, "children and status after the restart")
        print(f"OUTCOME operator killed before {method} {fragment.rsplit('/', 1)[-1]} -> the restarted process "
              f"converged in {time.monotonic() - started:.1f} s")
        for role in ("prefill", "decode", "router"):
            play_controller(server, role)
        wait_for(cond_is(server, "Ready", "True"), CONVERGE_S, "Ready")
        now = children(server)
        assert {k: now[k] for k in written} == written, "children written before the kill are kept"
        posted = [r.path for r in server.emulator.requests[since:] if r.method == "POST" and "/events" not in r.path]
        assert len(posted) == len(now) - len(written), f"only the missing children are created: {posted}"
        assert not [r for r in server.emulator.requests if r.method == "DELETE"]
        status = cr(server)["status"]
        assert status["observedGeneration"] == cr(server)["metadata"]["generation"]
        assert {c["type"] for c in status["conditions"]} >= {"Ready", "Progressing", "Degraded"}
    finally:
        for proc in (first, second):
            if proc is not None:
                kill(proc)
        log.close()
