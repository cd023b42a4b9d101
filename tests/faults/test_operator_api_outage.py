"""The API server unavailable under a running operator (kopf in a thread, reaching the emulated API server through a
Link): connections refused and open watches cut, then every request answered 503, then back. Meanwhile someone
changes the spec. The operator backs off, resumes and converges: the change applied, no child created twice,
status complete. Its API backoffs are short here (a few tries a second) so the outage outlasts kopf's default
8 tries: with kopf's default the watch would give up and the operator would stay deaf."""
from __future__ import annotations

import time

from waiting import wait_for

from ctl_fixtures import api_fixture, example_fixture  # noqa: F401 (fixtures api, example)
from operator_harness import OperatorThread
from test_operator import CHILDREN, NAME, NS, all_children, children_created, cond_is, cr, create, deployment, \
    patch_spec, play_controller

from disagg.operator.backoff import EndlessBackoffs

OUTAGE_S = 3.0  # per phase: refused, then 503
FAST_BACKOFFS = EndlessBackoffs(first=0.05, cap=0.2)  # ~20 tries per phase: far past kopf's default 8
CONVERGE_S = 20.0  # after the API server is back (the pass's own retry delay is at most 2 ** retries)


def uids(server) -> dict[tuple, str]:
    return {(res, o["metadata"]["name"]): o["metadata"]["uid"] for res, objs in all_children(server).items()
            for o in objs}


def creates(server, since: int = 0) -> list[str]:
    return [r.path for r in server.emulator.requests[since:] if r.method == "POST" and "/events" not in r.path]


def test_api_server_refusing_then_failing_then_back_converges_without_duplicates_or_lost_status(api, example):
    server, link = api
    example["spec"]["autoscaling"]["enabled"] = False  # the spec alone sets the replicas here
    example["spec"]["decode"]["replicas"] = 1
    op = OperatorThread(memo={"api_backoffs": FAST_BACKOFFS}).start()
    try:
        create(server, example)
        wait_for(lambda: children_created(server), what="all children")
        for role in ("prefill", "decode", "router"):
            play_controller(server, role)
        wait_for(cond_is(server, "Ready", "True"), what="Ready")
        before, first_gen = uids(server), cr(server)["metadata"]["generation"]
        n_creates = len(creates(server))

        link.down()  # refused; the operator's watches are cut
        patch_spec(server, {"decode": {"replicas": 2}})  # another client, through a working API server
        time.sleep(OUTAGE_S)
        link.up("503")
        time.sleep(OUTAGE_S)
        assert cr(server)["status"]["observedGeneration"] == first_gen, "nothing reached the API server"
        assert deployment(server, "decode")["spec"]["replicas"] == 1
        link.up()
        back = time.monotonic()

        wait_for(lambda: deployment(server, "decode")["spec"]["replicas"] == 2, CONVERGE_S, "the change applied")
        wait_for(lambda: cr(server)["status"]["observedGeneration"] == first_gen + 1, CONVERGE_S,
                 "status of the new generation")
        print(f"OUTCOME API server refused {OUTAGE_S:g} s + 503 {OUTAGE_S:g} s -> converged "
              f"{time.monotonic() - back:.1f} s after it came back")
        play_controller(server, "decode")
        wait_for(cond_is(server, "Ready", "True"), CONVERGE_S, "Ready again")
        status = cr(server)["status"]
        assert uids(server) == before, "every child kept (same uid), none added"
        assert {res: {o["metadata"]["name"] for o in objs} for res, objs in all_children(server).items()} == CHILDREN
        assert len(creates(server)) == n_creates, "nothing created again"
        assert not [r for r in server.emulator.requests if r.method == "DELETE"]
        assert {c["type"] for c in status["conditions"]} >= {"Ready", "Progressing", "Degraded"}
        assert all(c.get("lastTransitionTime") for c in status["conditions"])
        assert status["decode"]["readyReplicas"] == 2 and status["prefill"]["readyReplicas"] == 2
        assert status["revision"] and status["endpoint"].startswith(f"http://{NAME}.{NS}.svc")
    finally:
        op.stop()
