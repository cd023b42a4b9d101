"""Clients that leave mid-request, many of them, through the router into 1 prefill + 1 decode worker over NIXL:
streamed completions at ~40 req/s for 20 s, each client gone after a random 0-0.4 s (before its prefill, between
the hops, while its KV is read, or mid-stream). Afterwards every worker reads idle (nothing running or waiting, no
KV held once the short lease is over), the decode worker's engine thread is idle instead of stepping, and a new
request gets its whole answer.

Found with bench/overload.py: a client that left after its KV had landed at the decode but before the step that
would admit it left the request waiting for a transfer that had already been reported - its blocks held for good,
and the decode's engine stepping without a pause (a whole core) from then on."""
from __future__ import annotations

import asyncio
import os
import time

import pytest
from serving_helpers import NIXL_MISSING, nixl_available

from ctl_fixtures import LEASE_S, wait_idle
from overload_fixtures import body, offer, pd_fleet, read_stream

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not nixl_available(), reason=NIXL_MISSING)]

RATE, SECONDS, MAX_STAY_S = 40.0, 20.0, 0.4
IDLE_ENGINE_CORES = 0.3  # an idle worker's process (probes, metrics) uses a few percent of a core


@pytest.fixture(scope="module")
def pd(tiny_model_dir, tmp_path_factory):
    with pd_fleet(tmp_path_factory.mktemp("leave"), tiny_model_dir, connector="NixlConnector") as pd:
        yield pd


def process_cores(pid: int, seconds: float = 3.0) -> float:
    def jiffies() -> int:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])
    before = jiffies()
    time.sleep(seconds)
    return (jiffies() - before) / os.sysconf("SC_CLK_TCK") / seconds


def test_clients_that_leave_at_any_moment_leave_no_kv_held_and_no_engine_busy(pd, record_outcome):
    router, fleet = pd["router"], pd["fleet"]
    sent = asyncio.run(offer(router, RATE, SECONDS, body(32), seed=7, leave_within_s=MAX_STAY_S))
    left = sum(s.left for s in sent)
    assert left > 100, f"only {left} clients left before their answer's end: the case did not happen"
    started = time.monotonic()
    wait_idle(pd["workers"])
    idle_s = time.monotonic() - started
    cores = process_cores(fleet.procs["decode-0"].popen.pid)
    record_outcome(f"{left} clients left mid-request (NIXL)", f"workers idle; decode then {cores:.2f} cores",
                   idle_s, LEASE_S + 20.0)
    assert cores < IDLE_ENGINE_CORES, f"the decode worker keeps {cores:.2f} cores busy with nothing to do"
    end = read_stream(router, body(8))
    assert end.kind == "whole" and end.tokens == 8, end
