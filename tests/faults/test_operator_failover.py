"""The operator killed mid-scale: the decode pool scaled from 1 to 3 replicas in the spec, the operator's write of the
Deployment held (answered 503 until the kill), the operator SIGKILLed, then

- restarted (one replica): the new process converges - decode at 3 replicas, status Ready;
- failed over (two replicas peered through a KopfPeering, kopf's coordination: the active one, of the higher
  priority, is killed; the standby takes over once the dead peer's lease runs out): the survivor converges.

Either way the children written before the kill are kept (same uid), none is created twice, none deleted.
kopf's peering lease is 60 s by default; the peered processes here run with 5 s (a startup handler the test adds
around the operator's own registry) to bound the case's wall time."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from waiting import wait_for

from ctl_fixtures import api_fixture, example_fixture  # noqa: F401 (fixtures api, example)
from emulator import Kind
from operator_harness import RESYNC_SECONDS
from test_operator import NAME, NS, children_created, cond_is, cr, create, deployment, patch_spec, play_controller
from test_operator_killed import children

pytestmark = pytest.mark.slow

CONVERGE_S = 60.0
PEERING = "disagg"
LEASE_S = 5  # the peered processes' kopf peering lifetime
PEERING_KIND = ("kopf.dev", "v1", "kopfpeerings")
DECODE_PATH = f"/deployments/{NAME}-decode"
# kopf's log lines as a peered operator turns active or stands by (a replica starts standing by)
PEERING_STATES = {"Resuming operations after the pause": "active", "Pausing operations in favour of": "standby"}

# the operator's own command, with kopf's peering lease shortened by one more startup handler
PEERED = textwrap.dedent(f"""
    import sys
    import kopf
    from disagg.operator import handlers

    build = handlers.build_registry

    def build_registry(*args, **kw):
        registry = build(*args, **kw)

        @kopf.on.startup(registry=registry)
        def short_lease(settings, **_):
            settings.peering.lifetime = {LEASE_S}

        return registry

    handlers.build_registry = build_registry
    from disagg.worker.cli import main
    sys.exit(main())
""")


def start(tmp_path: Path, *extra: str) -> subprocess.Popen:
    """The n-th operator process started here; its log is tmp_path/operator-<n>.log."""
    script = tmp_path / "peered_operator.py"
    script.write_text(PEERED)
    with open(tmp_path / f"operator-{len(list(tmp_path.glob('operator-*.log')))}.log", "w") as out:
        return subprocess.Popen([sys.executable, str(script), "operator", "--namespace", NS, "--resync-seconds",
                                 str(RESYNC_SECONDS), "--log-level", "INFO", *extra], env=dict(os.environ),
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def peering_state(tmp_path: Path, n: int) -> str:
    """'active' or 'standby', from the last peering line the n-th operator process logged."""
    state = "standby"
    for line in (tmp_path / f"operator-{n}.log").read_text().splitlines():
        state = next((v for k, v in PEERING_STATES.items() if k in line), state)
    return state


def kill(proc: subprocess.Popen | None) -> None:
    if proc is not None and proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    if proc is not None:
        proc.wait(10)


def uids(server) -> dict[tuple, str]:
    return dict(children(server))


def observed(server) -> bool:
    return cr(server)["status"].get("observedGeneration") == cr(server)["metadata"]["generation"]


def converged(server) -> None:
    """Children and a Ready status, playing the Deployment controller."""
    wait_for(lambda: children_created(server) and (cr(server).get("status") or {}).get("conditions"), CONVERGE_S,
             "children and status")
    for role in ("prefill", "decode", "router"):
        play_controller(server, role)
    wait_for(cond_is(server, "Ready", "True"), CONVERGE_S, "Ready")


@pytest.mark.parametrize("mode", ["restart", "failover"])
def test_operator_killed_mid_scale_converges_without_duplicates(api, example, tmp_path, mode, record_outcome):
    server, _ = api
    server.emulator.declare(*PEERING_KIND, Kind("KopfPeering"))
    with server.client() as http:
        http.post(f"/apis/kopf.dev/v1/namespaces/{NS}/kopfpeerings",
                  json={"apiVersion": "kopf.dev/v1", "kind": "KopfPeering",
                        "metadata": {"name": PEERING, "namespace": NS}}).raise_for_status()
    example["spec"]["decode"]["replicas"] = 1
    example["spec"].setdefault("autoscaling", {})["enabled"] = False
    peered = ["--peering", PEERING] if mode == "failover" else []
    procs: list[subprocess.Popen] = []
    try:
        procs.append(start(tmp_path, *peered, "--priority", "2"))
        if mode == "failover":
            procs.append(start(tmp_path, *peered, "--priority", "1"))
        create(server, example)
        converged(server)
        before = uids(server)
        server.emulator.inject_failure("PATCH", DECODE_PATH, 503, times=10**6)
        since = len(server.emulator.requests)
        patch_spec(server, {"decode": {"replicas": 3}})
        wait_for(lambda: sum(r.method == "PATCH" and DECODE_PATH in r.path
                             for r in server.emulator.requests[since:]) >= 2, CONVERGE_S, "the scale write held")
        if mode == "failover":
            assert [peering_state(tmp_path, n) for n in (0, 1)] == ["active", "standby"], "one active, one standing by"
        active = procs[0]
        kill(active)
        killed = time.monotonic()
        server.emulator.failures.clear()
        since = len(server.emulator.requests)
        if mode == "restart":
            procs.append(start(tmp_path, "--priority", "2"))
        wait_for(lambda: (deployment(server, "decode") or {}).get("spec", {}).get("replicas") == 3, CONVERGE_S,
                 "decode scaled to 3 by the " + ("restarted" if mode == "restart" else "surviving") + " operator")
        play_controller(server, "decode")
        # Ready was already True before the scale: converged is Ready for the spec's generation
        wait_for(lambda: cond_is(server, "Ready", "True")() and observed(server), CONVERGE_S, "Ready after the scale")
        took = time.monotonic() - killed
        record_outcome(f"operator killed mid-scale ({mode})", "converged, no duplicates", took,
                       CONVERGE_S if mode == "restart" else LEASE_S + CONVERGE_S)
        assert uids(server) == before, "the children are the ones written before the kill"
        posted = [r.path for r in server.emulator.requests[since:] if r.method == "POST"
                  and "/events" not in r.path and "kopfpeerings" not in r.path]
        assert posted == [], f"nothing created again: {posted}"
        assert not [r for r in server.emulator.requests if r.method == "DELETE" and "kopfpeerings" not in r.path]
        if mode == "failover":
            assert procs[1].poll() is None, "the survivor is running"
            assert peering_state(tmp_path, 1) == "active", "the standby took over"
    finally:
        for p in procs:
            kill(p)
