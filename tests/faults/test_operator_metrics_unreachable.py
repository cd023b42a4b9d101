"""The autoscaler while the workers' metrics cannot be read: every worker pod's /metrics behind a Link, first refusing
connections, then hanging (accepted, never answered). The pools are idle - with metrics the autoscaler would
scale decode down at once - yet it holds: replicas untouched, status and the ScalingActive condition say
MetricsMissing, every pass bounded by metricsSource.timeoutSeconds. Metrics back: scaling resumes."""
from __future__ import annotations

import time

from waiting import wait_for

from ctl_fixtures import Link, api_fixture, example_fixture  # noqa: F401 (fixtures api, example); first: sys.path
from fake_worker import FakeWorker
from operator_harness import OperatorThread
from test_autoscaling import autoscaling_spec, autoscaling_status, replicas, start
from test_operator import NAME, NS, cr

INTERVAL_S, SCRAPE_TIMEOUT_S = 1, 1
# several decisions' worth: a pass with hung metrics takes the scrape timeout, then waits the interval
HOLD_S = {"refused": 3 * INTERVAL_S + 1, "hang": 2 * (INTERVAL_S + SCRAPE_TIMEOUT_S) + 1}


def scaling_active(server) -> tuple[str, str, str] | None:
    c = next((c for c in (cr(server).get("status") or {}).get("conditions", []) if c["type"] == "ScalingActive"),
             None)
    return (c["status"], c["reason"], c["message"]) if c else None


def replica_writes(server, since: int) -> list:
    return [r for r in server.emulator.writes(since) if r.path.endswith(("-prefill", "-decode")) and
            "/deployments/" in r.path and "replicas" in ((r.body or {}).get("spec") or {})]


def test_autoscaler_holds_while_metrics_are_unreachable_and_resumes_when_they_are_back(api, example):
    server, _ = api
    op = OperatorThread().start()
    workers = {"prefill": [FakeWorker("prefill")], "decode": [FakeWorker("decode"), FakeWorker("decode")]}
    links = {role: [Link(w.port) for w in ws] for role, ws in workers.items()}
    try:
        doc = autoscaling_spec(example, intervalSeconds=INTERVAL_S, metricsSource={"timeoutSeconds": SCRAPE_TIMEOUT_S})
        start(server, doc, links)  # the pods' metrics port is their link's; links not up yet: refused
        get = op.metrics.registry.get_sample_value
        labels = {"namespace": NS, "name": NAME, "role": "decode", "reason": "MetricsMissing"}
        for mode in ("refused", "hang"):
            if mode == "hang":
                for link in links["prefill"] + links["decode"]:
                    link.up("hang")
            since, held = len(server.emulator.requests), get("disagg_operator_scaling_decisions_total", labels) or 0
            wait_for(lambda: (scaling_active(server) or ("",))[:2] == ("False", "MetricsMissing"), 10,
                     f"ScalingActive False (MetricsMissing) with metrics {mode}")
            time.sleep(HOLD_S[mode])
            decisions = (get("disagg_operator_scaling_decisions_total", labels) or 0) - held
            print(f"OUTCOME worker metrics {mode} -> held at decode {replicas(server, 'decode')} over "
                  f"{decisions:g} decisions in {HOLD_S[mode]} s")
            assert decisions >= 2, "decisions go on, holding (each bounded by metricsSource.timeoutSeconds)"
            assert replicas(server, "decode") == 2 and replicas(server, "prefill") == 1
            assert replica_writes(server, since) == []
            status = autoscaling_status(server)["decode"]
            assert status["reason"] == "MetricsMissing" and status["desired"] == status["current"] == 2
            assert f"{NAME}-decode-{links['decode'][0].port}" in scaling_active(server)[2], "names the pods"
        for link in links["prefill"] + links["decode"]:
            link.up()
        back = time.monotonic()
        wait_for(lambda: replicas(server, "decode") == 1, 15, "scale-down of the idle decode pool")
        print(f"OUTCOME worker metrics back -> scaled decode 2 -> 1 in {time.monotonic() - back:.1f} s")
        wait_for(lambda: (scaling_active(server) or ("",))[0] == "True", 10, "ScalingActive True")
    finally:
        for link in links["prefill"] + links["decode"]:
            link.down()
        for w in workers["prefill"] + workers["decode"]:
            w.stop()
        op.stop()
