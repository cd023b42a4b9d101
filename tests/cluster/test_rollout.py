"""Scenario c: a rolling update (`kubectl patch` of spec.model.maxModelLen: a new serving revision) under steady
load. The Deployments surge a new prefill and a new decode pod, then remove the old ones as the new become ready.
No request fails, and throughout, every decode pod pulled KV only from prefill pods of its own revision (the
router pairs by the disagg.dev/revision label): each decode pod's NIXL peers, from its log, are checked against
the prefill pods' engine ids and revisions."""
from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
from serving_helpers import NIXL_MISSING, nixl_available

from scenario import Load, component, cr_manifest, delete_and_wait, live_pods, router_url, wait_ready
from waiting import wait_for

from disagg.operator import manifests as m
from disagg.operator import naming

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not nixl_available(), reason=NIXL_MISSING)]
NAME = "rollout"


def _log(cluster, pod_name: str, container: str) -> str:
    return (cluster.log_dir / f"default_{pod_name}_{container}.log").read_text()


def _cmdline(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")


def test_rolling_update_under_load_fails_no_request_and_pairs_prefill_and_decode_by_revision(cluster, checkpoint):
    t0 = time.monotonic()
    cluster.apply(cr_manifest(NAME, checkpoint))
    old_revision = wait_ready(cluster, NAME)["status"]["revision"]
    seen: dict[str, dict] = {}  # pod name -> the pod, every worker pod that ran during the test

    def remember() -> None:
        for role in ("prefill", "decode"):
            for p in cluster.pods(component(NAME, role)):
                seen[p["metadata"]["name"]] = p

    remember()
    load = Load(router_url(cluster, NAME), clients=2, max_tokens=16)
    try:
        cluster.patch_cr(NAME, {"spec": {"model": {"maxModelLen": 384}}})

        def rolled() -> bool:
            remember()
            cr = cluster.cr(NAME)
            pods = [p for role in ("prefill", "decode") for p in cluster.pods(component(NAME, role))]
            return cr["status"].get("revision") != old_revision and len(pods) == 2 and all(
                p["metadata"]["labels"][naming.LABEL_REVISION] == cr["status"]["revision"] for p in pods) \
                and cr["status"]["decode"]["readyReplicas"] == cr["status"]["prefill"]["readyReplicas"] == 1
        wait_for(rolled, 150, f"the rollout to finish\n{cluster.logs()}", interval=0.2)

        def new_decode_pulled() -> bool:  # the router discovers pods by polling: give it the time it needs
            return all("added peer" in _log(cluster, p["metadata"]["name"], "decode")
                       for p in live_pods(cluster, NAME, "decode"))
        wait_for(new_decode_pulled, 60, "the new revision's decode pod to pull KV", interval=0.2)
        time.sleep(1)  # steady load on the new revision only
    finally:
        outcomes = load.stop()
    new_revision = cluster.cr(NAME)["status"]["revision"]
    assert new_revision != old_revision
    assert outcomes and not load.failures(), load.failures()

    # the new pods run the new command line
    for pod in [*live_pods(cluster, NAME, "prefill"), *live_pods(cluster, NAME, "decode")]:
        (pid,) = cluster.kubelet.pids()[pod["metadata"]["name"]]
        argv = _cmdline(pid)
        assert argv[argv.index("--max-model-len") + 1] == "384", argv

    # pairing: every KV peer of a decode pod is a prefill pod of the decode pod's revision
    engines = {}  # prefill engine id -> revision
    for name, pod in seen.items():
        if pod["metadata"]["labels"][naming.LABEL_COMPONENT] == "prefill":
            match = re.search(r"NIXL connector: engine (\w+)", _log(cluster, name, "prefill"))
            assert match, name
            engines[match.group(1)] = pod["metadata"]["labels"][naming.LABEL_REVISION]
    assert set(engines.values()) == {old_revision, new_revision}, engines
    pulled = set()
    for name, pod in seen.items():
        if pod["metadata"]["labels"][naming.LABEL_COMPONENT] == "decode":
            revision = pod["metadata"]["labels"][naming.LABEL_REVISION]
            for peer in re.findall(r"added peer (\w+)", _log(cluster, name, "decode")):
                assert engines.get(peer) == revision, (name, revision, peer, engines)
                pulled.add(revision)
    assert pulled == {old_revision, new_revision}, pulled  # both revisions served through prefill
    t_delete = delete_and_wait(cluster, NAME)
    print(f"\nscenario c: {len(outcomes)} requests ok across the rollout, {len(seen)} worker pods; "
          f"{time.monotonic() - t0:.1f}s (delete {t_delete:.1f}s)")
