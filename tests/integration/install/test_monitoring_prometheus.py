"""The chart's dashboard and alerts against a real Prometheus (Debian's `prometheus`) on 127.0.0.1 scraping real
processes: a prefill and a decode worker (`disagg worker`, tiny checkpoint), two routers (`disagg router`: one
P/D; one whose only prefill worker crashed, so it falls back to decode alone) and the
operator's metrics server (the OperatorMetrics registry served by prometheus_client as `disagg operator
--metrics-port` does), fed by autoscaling decisions made on samples read from that Prometheus
(`metricsSource: prometheus`, operator/src/autoscaling/sources.py).

Targets carry the labels the chart's PodMonitors give them in a cluster (job = component, namespace, pod,
app_kubernetes_io_instance/component; honor_labels for the operator), so the queries run here unchanged."""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from prometheus_client import start_http_server

from prometheus_cli import (MISSING, SELECTOR, METRIC_NAME, PrometheusServer, alerts, binary, dashboard_queries,
                            exported_metric_names, load_dashboard, render_monitoring, substitute, write_rules_file)
from serving_helpers import nixl_available
from waiting import wait_for

from disagg.operator.autoscaling.policy import ScalingHistory, decide
from disagg.operator.autoscaling.inputs import AutoscalePolicy
from disagg.operator.autoscaling.cluster import OperatorMetrics
from disagg.operator.autoscaling.sources import PrometheusSource
from disagg.worker.local.process import LocalProcess, ProcessSpec, free_port, is_ready

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240),
              pytest.mark.skipif(binary("prometheus") is None, reason=MISSING)]

CLI = [sys.executable, "-m", "disagg.worker.cli"]
WORKER_FLAGS = ["--host", "127.0.0.1", "--dtype", "float32", "--max-model-len", "256", "--num-kv-blocks", "64",
                "--served-model-name", "tiny-llama"]
NS, RESOURCE = "ml", "llama"
VARIABLES = {"namespace": NS, "resource": RESOURCE, "role": "prefill|decode", "__rate_interval": "1m"}
CURRENT = {"prefill": 1, "decode": 1}
# a TTFT target far below what any request takes: the real prefill TTFT must make the autoscaler scale prefill up
POLICY = AutoscalePolicy(ttft_seconds=1e-4)


@dataclass
class Stack:
    prom: PrometheusServer
    dashboard: dict[str, Any]
    rule: dict[str, Any]
    decisions: list[Any] = field(default_factory=list)  # held, first real, second real


def _target(url: str, job: str, pod: str, **extra: Any) -> dict[str, Any]:
    labels = {"namespace": NS, "pod": pod, "app_kubernetes_io_instance": RESOURCE, "app_kubernetes_io_component": job}
    return {"job_name": pod, "honor_labels": False, **extra, "metrics_path": "/metrics",
            "static_configs": [{"targets": [url.removeprefix("http://")], "labels": {"job": job, **labels}}]}


def _complete(router: str, n: int, stream: bool) -> None:
    for i in range(n):
        body = {"model": "tiny-llama", "prompt": f"the quick brown fox {i} jumps over", "max_tokens": 6,
                "stream": stream}
        with httpx.stream("POST", f"{router}/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200, r.read()
            r.read()


def _value(prom: PrometheusServer, promql: str) -> float:
    result = prom.query(promql)["data"]["result"]
    return float(result[0]["value"][1]) if result else float("nan")


def _scraped(prom: PrometheusServer, promql: str, want: float) -> bool:
    return _value(prom, promql) == want


@pytest.fixture(scope="module")
def stack(tiny_model_dir, tmp_path_factory):
    work = tmp_path_factory.mktemp("monitoring")
    cm, rule = render_monitoring(tmp_path_factory.mktemp("helm"))
    rules = write_rules_file(rule, work / "rules.yaml")
    connector = ["--kv-connector", "NixlConnector", "--kv-side-channel-host", "127.0.0.1"] if nixl_available() \
        else ["--kv-connector", "SharedStorageConnector", "--kv-shared-storage-path", str(work / "kv")]
    procs: list[LocalProcess] = []
    metrics = OperatorMetrics()
    op_port = free_port()
    httpd, _ = start_http_server(op_port, addr="127.0.0.1", registry=metrics.registry)
    prom = None
    try:
        urls = {}
        # "prefill-crashing": the fallback router's only prefill worker, killed once that router saw it ready
        for name, role in (("prefill", "prefill"), ("decode", "decode"), ("prefill-crashing", "prefill")):
            port = free_port()
            side = ["--kv-side-channel-port", str(free_port())] if nixl_available() else []
            spec = ProcessSpec(name, [*CLI, "worker", "--role", role, "--model", tiny_model_dir, "--port", str(port),
                                      *WORKER_FLAGS, *connector, *side], f"http://127.0.0.1:{port}")
            procs.append(LocalProcess(spec, work))
            urls[name] = spec.url
        _start_ready(procs)
        routers = []
        for name, prefill, probe_s in (("router", urls["prefill"], "0.5"),
                                       ("router-fallback", urls["prefill-crashing"], "3600")):
            port = free_port()
            spec = ProcessSpec(name, [*CLI, "router", "--host", "127.0.0.1", "--port", str(port), "--probe-interval",
                                      probe_s, "--prefill", prefill, "--decode", urls["decode"]],
                               f"http://127.0.0.1:{port}")
            routers.append(LocalProcess(spec, work))
            urls[name] = spec.url
        procs += routers
        _start_ready(routers)
        crashing = procs[2]
        crashing.kill()  # a crash: the fallback router learns of it from its next request only
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(rules)],
            "scrape_configs": [
                _target(urls["prefill"], "prefill", f"{RESOURCE}-prefill-0"),
                _target(urls["decode"], "decode", f"{RESOURCE}-decode-0"),
                _target(urls["router"], "router", f"{RESOURCE}-router-0"),
                _target(urls["router-fallback"], "router", f"{RESOURCE}-router-1"),
                {"job_name": "disagg-operator", "honor_labels": True,  # as the chart's operator PodMonitor
                 "static_configs": [{"targets": [f"127.0.0.1:{op_port}"],
                                     "labels": {"namespace": "disagg-system", "pod": "disagg-operator-0"}}]},
            ],
        }
        prom = PrometheusServer(config, work, free_port())
        wait_for(prom.ready, 30, "prometheus ready", interval=0.2)
        stack = Stack(prom, load_dashboard(cm), rule)
        _drive(stack, urls, metrics)
        yield stack
    finally:
        for p in procs:
            p.terminate()
        codes = {p.spec.name: p.popen.wait(30) for p in procs}
        if prom is not None:
            prom.stop()
        httpd.shutdown()
        httpd.server_close()
    assert codes == {p.spec.name: -9 if p.spec.name == "prefill-crashing" else 0 for p in procs}


def _start_ready(procs: list[LocalProcess]) -> None:
    for p in procs:
        p.start()
    for p in procs:
        wait_for(lambda: p.exited() is not None or is_ready(p.spec.url), 120, f"{p.spec.name} ready", interval=0.2)
        assert p.exited() is None, f"{p.spec.name} exited:\n{p.log_tail(40)}"


def _drive(stack: Stack, urls: dict[str, str], metrics: OperatorMetrics) -> None:
    """Traffic through both routers, and the autoscaler's decisions on what Prometheus then holds."""
    prom = stack.prom
    source = PrometheusSource(prom.url, selector=f'namespace="{NS}",app_kubernetes_io_instance="{RESOURCE}"')
    nowhere = PrometheusSource(prom.url, selector='namespace="nowhere"')
    # held twice, a scrape apart, as an operator holding every interval: increase() sees the counter move
    held = decide({"prefill": nowhere.fetch()}, CURRENT, POLICY, ScalingHistory(), time.time())
    metrics.observe(NS, RESOURCE, held)
    wait_for(lambda: _scraped(prom, 'sum(disagg_operator_scaling_decisions_total{reason="MetricsMissing"})', 2), 30,
             "the held decisions scraped", interval=0.2)
    metrics.observe(NS, RESOURCE, held)
    stack.decisions.append(held)
    _complete(urls["router"], 3, stream=True)
    _complete(urls["router"], 1, stream=False)
    # a scrape between the two: the router creates its counters at their first event, and Prometheus sees no
    # increase in a series that first appears already at 2
    _complete(urls["router-fallback"], 1, stream=False)
    wait_for(lambda: _scraped(prom, "sum(disagg:router_decode_alone_total)", 1), 30, "the fallback scraped",
             interval=0.2)
    _complete(urls["router-fallback"], 1, stream=False)
    # every pod scraped after its last request (each target has its own scrape times)
    served = 'sum(vllm:request_success_total{role="decode"}) + 100 * sum(vllm:request_success_total{role="prefill"})'
    wait_for(lambda: _scraped(prom, served, 6 + 100 * 4), 30, "the requests scraped", interval=0.2)
    history = ScalingHistory()
    for batch in (1, 2):
        if batch == 2:
            _complete(urls["router"], 3, stream=True)
            wait_for(lambda: _scraped(prom, served, 9 + 100 * 7), 30, "the second batch scraped", interval=0.2)
        samples = source.fetch()
        assert isinstance(samples, list), samples
        by_role = {r: [s for s in samples if s.role == r] for r in CURRENT}
        d = decide(by_role, CURRENT, POLICY, history, time.time())
        history = d.history
        metrics.observe(NS, RESOURCE, d)
        stack.decisions.append(d)
    # the operator's series scraped at least twice after the last decision (rates and increases need two points)
    wait_for(lambda: _value(prom, 'count_over_time(disagg_operator_desired_replicas{role="prefill"}[3s])') >= 2
             and _scraped(prom, 'disagg_operator_desired_replicas{role="prefill"}',
                          stack.decisions[-1].roles["prefill"].desired), 30, "the decisions scraped", interval=0.2)


def test_prometheus_source_drives_a_scaling_decision(stack):
    held, first, second = stack.decisions
    assert {r: d.reason for r, d in held.roles.items()} == {"prefill": "MetricsMissing", "decode": "MetricsMissing"}
    assert first.roles["prefill"].desired == 1  # no TTFT window yet: one sample per pod
    # the window between the two reads holds the second batch's prefill TTFTs, all far above 0.1 ms
    assert (second.roles["prefill"].reason, second.roles["prefill"].desired) == ("PrefillBound", 2)
    assert second.roles["decode"].desired == 1


def test_every_dashboard_query_parses_names_exported_metrics_and_returns_series(stack):
    exported = exported_metric_names()
    empty = []
    for title, expr in dashboard_queries(stack.dashboard):
        assert set(METRIC_NAME.findall(expr)) <= exported, f"{title}: {expr}"
        answer = stack.prom.query(substitute(expr, VARIABLES))
        assert answer["status"] == "success", f"{title}: {expr}: {answer.get('error')}"
        if not answer["data"]["result"]:
            empty.append(f"{title}: {expr}")
    assert not empty, "queries without series:\n" + "\n".join(empty)


def test_dashboard_variables_list_the_namespace_resource_and_roles(stack):
    found = {}
    for var in stack.dashboard["templating"]["list"]:
        if var["type"] != "query":
            continue
        selector, label = var["query"]["query"].removeprefix("label_values(").removesuffix(")").rsplit(", ", 1)
        answer = stack.prom.query(f"group by ({label}) ({substitute(selector, VARIABLES)})")
        found[var["name"]] = {s["metric"][label] for s in answer["data"]["result"]}
    assert found == {"namespace": {NS}, "resource": {RESOURCE}, "role": {"prefill", "decode"}}


def test_every_alert_expression_evaluates_and_each_selector_returns_series(stack):
    empty = []
    for name, expr in alerts(stack.rule).items():
        answer = stack.prom.query(expr)
        assert answer["status"] == "success", f"{name}: {answer.get('error')}"
        for metric, matchers in SELECTOR.findall(expr):
            if not stack.prom.query(f"count({metric}{matchers})")["data"]["result"]:
                empty.append(f"{name}: {metric}{matchers}")
    assert not empty, "alert selectors without series:\n" + "\n".join(empty)


def test_rules_evaluate_in_prometheus_and_the_real_faults_raise_their_alerts(stack):
    """Prometheus runs the rendered rules: none errors, and the two faults this stack really has (a router
    decoding alone, an autoscaler held for missing metrics) make exactly their alerts pending."""
    def active() -> set[str] | None:
        groups = httpx.get(f"{stack.prom.url}/api/v1/rules", timeout=5).json()["data"]["groups"]
        rules = [r for g in groups for r in g["rules"]]
        assert {r["name"] for r in rules} == set(alerts(stack.rule))
        bad = [(r["name"], r.get("lastError")) for r in rules if r["health"] not in ("ok", "unknown")]
        assert not bad, bad
        if any(r["health"] == "unknown" for r in rules):
            return None
        return {r["name"] for r in rules if r["state"] in ("pending", "firing")}
    want = {"DisaggRouterDecodeAlone", "DisaggScalingHeldMetricsMissing"}
    deadline, now_active = time.monotonic() + 60, active()  # rule evaluation and scrapes lag on a loaded box
    while now_active != want and time.monotonic() < deadline:
        time.sleep(0.5)
        now_active = active()
    assert now_active == want
