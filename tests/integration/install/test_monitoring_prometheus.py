"""The chart's dashboard and alerts against a real Prometheus (Debian's `prometheus`) on 127.0.0.1 scraping real
processes, once per engine: a prefill and a decode worker (engine disagg: `disagg worker`, tiny checkpoint; engine
vllm: `vllm serve` as `disagg up` plans it, skipped without $DISAGG_VLLM), two routers (`disagg router`: one P/D;
one whose only prefill endpoint crashed after the router saw it ready, so it falls back to decode alone) and the
operator's metrics server (the OperatorMetrics registry served by prometheus_client as `disagg operator
--metrics-port` does), fed by the operator's autoscaling pass on samples read from that Prometheus
(`metricsSource: prometheus`, operator/src/autoscaling/cluster.from_prometheus).

The worker and router targets are scraped as the chart's worker PodMonitor makes the Prometheus Operator scrape
them (prometheus_cli.pod_monitor_scrape_configs): each is a pod labelled as the operator labels its pods, and the
PodMonitor's relabelings run, so `role` and `resource` come from the pod's labels whatever the engine exports. The
operator's target carries the labels its own PodMonitor gives it (honor_labels), so the queries run here
unchanged."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from monitoring_stack import CLI, CrashingPrefill, operator_pod_labels, start_ready, worker_processes
from prometheus_client import start_http_server
from serving_helpers import metric, metric_sum

from prometheus_cli import (MISSING, SELECTOR, METRIC_NAME, DiscoveredPod, PrometheusServer, alerts, binary,
                            dashboard_queries, exported_metric_names, load_dashboard, pod_monitor_scrape_configs,
                            render_monitoring, render_worker_pod_monitor, substitute, write_rules_file)
from vllm_fleet import SKIP_REASON, STARTUP_S, vllm_executable, write_vllm_checkpoint
from waiting import wait_for

from disagg.operator import spec as s
from disagg.operator.router_command import bound_args
from disagg.operator.autoscaling.cluster import OperatorMetrics, PodTarget, from_prometheus, scaling_status
from disagg.operator.autoscaling.inputs import AutoscalePolicy
from disagg.operator.autoscaling.policy import ScalingHistory, decide
from disagg.operator.autoscaling.scaling_pass import PassState, run_pass
from disagg.operator.autoscaling.sources import PrometheusSource
from disagg.worker.local.process import LocalProcess, ProcessSpec, free_port
from disagg.worker.router.discovery import write_endpoints
from disagg.worker.router.hop_bodies import prefill_body

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240),
              pytest.mark.skipif(binary("prometheus") is None, reason=MISSING)]

MODEL = "tiny-llama"
WORKER_FLAGS = ["--host", "127.0.0.1", "--dtype", "float32", "--max-model-len", "256", "--num-kv-blocks", "64",
                "--served-model-name", MODEL]
NS, RESOURCE = "ml", "llama"
VARIABLES = {"namespace": NS, "resource": RESOURCE, "role": "prefill|decode", "__rate_interval": "1m"}
CURRENT = {"prefill": 1, "decode": 1}
# a TTFT target far below what any request takes: the real prefill TTFT must make the autoscaler scale prefill up
POLICY = AutoscalePolicy(ttft_seconds=1e-4)
ENGINES = ["disagg", pytest.param("vllm", marks=[pytest.mark.skipif(vllm_executable() is None, reason=SKIP_REASON),
                                                 pytest.mark.timeout(STARTUP_S + 300)])]
# panels split by role whose every query has series of both worker roles (at the decode alone there is no prefill
# to tell apart from; latency panels may hold one role's observations only)
BOTH_ROLES = {"Request rate per role", "Time to first token", "Queue length", "KV-cache usage", "Preemptions",
              "Desired vs serving replicas"}


@dataclass
class Stack:
    engine: str
    prom: PrometheusServer
    dashboard: dict[str, Any]
    rule: dict[str, Any]
    decisions: list[Any] = field(default_factory=list)  # held, first real, second real
    statuses: list[dict[str, Any]] = field(default_factory=list)  # the operator's status.autoscaling of each


@pytest.fixture(scope="module", params=ENGINES)
def stack(request, tiny_model_dir, tmp_path_factory):
    engine = request.param
    work = tmp_path_factory.mktemp(f"monitoring-{engine}")
    helm = tmp_path_factory.mktemp("helm")
    # vLLM's CPU build on 2 shared cores misses the default 1 s TTFT SLO (its first NIXL handshake alone can take
    # seconds, and a loaded CI run once took over 10 s for one of the six streamed requests): the SLO is set above
    # the 120 s the clients below wait, so only the stack's real faults raise alerts
    cm, rule = render_monitoring(helm, *(["--set-string", "monitoring.prometheusRule.ttftSeconds=160.0"]
                                         if engine == "vllm" else []))
    monitor = render_worker_pod_monitor(helm)
    rules = write_rules_file(rule, work / "rules.yaml")
    model_dir = write_vllm_checkpoint(work / "vllm-tiny") if engine == "vllm" else tiny_model_dir
    procs: list[LocalProcess] = []
    crashing = CrashingPrefill(MODEL)
    metrics = OperatorMetrics()
    op_port = free_port()
    httpd, _ = start_http_server(op_port, addr="127.0.0.1", registry=metrics.registry)
    prom = None
    try:
        workers = worker_processes(engine, model_dir, MODEL, work, WORKER_FLAGS)
        procs += [LocalProcess(spec, work) for spec in workers.values()]
        start_ready(procs, STARTUP_S if engine == "vllm" else 120)
        pods = {spec.url: f"{RESOURCE}-{role}-0" for role, spec in workers.items()}
        routers = _routers(engine, workers, pods, crashing, work)
        procs += routers
        start_ready(routers, 120)
        for router in routers:
            wait_for(lambda: httpx.get(f"{router.spec.url}/ready", timeout=30).json().get("prefill_ready"), 30,
                     f"{router.spec.name} to see its prefill ready", interval=0.2)
        crashing.crash()  # the fallback router learns of it from its next request only
        labels = operator_pod_labels(NS, RESOURCE)
        targets = [DiscoveredPod(w.url.removeprefix("http://"), NS, pods[w.url], labels[role])
                   for role, w in workers.items()]
        targets += [DiscoveredPod(p.spec.url.removeprefix("http://"), NS, f"{RESOURCE}-router-{i}", labels["router"])
                    for i, p in enumerate(routers)]
        config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"}, "rule_files": [str(rules)],
                  "scrape_configs": [*pod_monitor_scrape_configs(monitor, targets), _operator_job(op_port)]}
        prom = PrometheusServer(config, work, free_port())
        wait_for(prom.ready, 30, "prometheus ready", interval=0.2)
        stack = Stack(engine, prom, load_dashboard(cm), rule)
        if engine == "vllm":
            _warm_up(workers["prefill"].url, workers["decode"].url)
        base = _served(workers)  # the metered traffic's counts are read on top of the warm-up's
        _drive(stack, {"router": routers[0].spec.url, "router-fallback": routers[1].spec.url}, metrics, targets,
               base)
        yield stack
    finally:
        crashing.crash()
        for p in procs:
            p.terminate()
        codes = {p.spec.name: p.popen.wait(60) for p in procs if p.popen is not None}
        if prom is not None:
            prom.stop()
        httpd.shutdown()
        httpd.server_close()
    assert codes == {p.spec.name: 0 for p in procs}, "\n".join(p.log_tail(30) for p in procs)


def _routers(engine: str, workers: dict[str, ProcessSpec], pods: dict[str, str], crashing: CrashingPrefill,
             work: Path) -> list[LocalProcess]:
    """The P/D router (following an endpoints file that names the workers' pods, as Kubernetes discovery does),
    and one whose only prefill endpoint is `crashing`; both with the bounds the operator gives a router of this
    engine (vLLM's API server answers probes and connections late while its engine keeps 2 cores busy: with the
    engine disagg defaults, 5 s to connect and 8 s of late probes, its first P/D request got a 504)."""
    router = s.RouterSpec.model_validate({"timeouts": {"connectSeconds": 60 if engine == "vllm" else 5}})
    bounds = bound_args(router, engine)
    endpoints = work / "endpoints.json"
    write_endpoints(endpoints, [workers["prefill"].url], [workers["decode"].url], names=pods)
    routers = []
    for name, where in (("router", ["--discovery", "file", "--endpoints-file", str(endpoints),
                                    "--probe-interval", "0.5"]),
                        ("router-fallback", ["--prefill", crashing.url, "--decode", workers["decode"].url,
                                             "--probe-interval", "3600"])):
        port = free_port()
        routers.append(LocalProcess(ProcessSpec(name, [*CLI, "router", "--host", "127.0.0.1", "--port", str(port),
                                                       *where, *bounds], f"http://127.0.0.1:{port}"), work))
    return routers


def _operator_job(port: int) -> dict[str, Any]:
    """The operator's metrics as its PodMonitor scrapes them (honorLabels: the series' own namespace wins)."""
    return {"job_name": "disagg-operator", "honor_labels": True,
            "static_configs": [{"targets": [f"127.0.0.1:{port}"],
                                "labels": {"namespace": "disagg-system", "pod": "disagg-operator-0"}}]}


def _complete(router: str, n: int, stream: bool, prompt: str = "the quick brown fox") -> None:
    for i in range(n):
        body = {"model": MODEL, "prompt": f"{prompt} {i} jumps over", "max_tokens": 6, "stream": stream}
        with httpx.stream("POST", f"{router}/v1/completions", json=body, timeout=120) as r:
            assert r.status_code == 200, r.read()
            r.read()


def _warm_up(prefill: str, decode: str) -> None:
    """One P/D hand-off straight between the two vLLM pods (as a router's hops make it; no router counts it) until
    the decode has pulled KV once: its first NIXL handshake with the prefill took 60 s in a CI run (the prefill's
    VLLM::Worker busy on its one core), long enough for the routers to take the prefill for hung and decode alone -
    which the metered traffic below must not meet."""
    body = {"model": MODEL, "prompt": "warm up the hand-off", "max_tokens": 2}

    def pulled() -> bool:
        try:
            answer = httpx.post(f"{prefill}/v1/completions", json=prefill_body(body), timeout=120).json()
            handoff = answer.get("kv_transfer_params")
            httpx.post(f"{decode}/v1/completions", json={**body, "kv_transfer_params": handoff}, timeout=300)
            return metric(decode, "vllm:nixl_xfer_time_seconds_count", 0.0) > 0
        except (httpx.HTTPError, ValueError):
            return False

    wait_for(pulled, 400, "the vLLM decode's first KV pull", interval=1.0)
    # a try whose KV the decode read late (60 s on a busy CI run) holds its blocks at the prefill until vLLM's
    # lease (30 s) expires them, and the expiry is counted at the prefill's next step: within the metered
    # traffic, the autoscaler would read it as KV waiting to be pulled (DecodeBound) - the blocks freed first
    wait_for(lambda: metric_sum(prefill, "vllm:kv_cache_usage_perc", 1.0, timeout=30) == 0, 120,
             "the warm-up's KV released at the vLLM prefill", interval=1.0)


def _served(workers: dict[str, ProcessSpec]) -> float:
    """The `served` sum of _drive, read from the workers themselves (every finished_reason's series)."""
    return (metric_sum(workers["decode"].url, "vllm:request_success_total", 0.0, timeout=60)
            + 100 * metric_sum(workers["prefill"].url, "vllm:request_success_total", 0.0, timeout=60))


def _value(prom: PrometheusServer, promql: str) -> float:
    result = prom.query(promql)["data"]["result"]
    return float(result[0]["value"][1]) if result else float("nan")


def _scraped(prom: PrometheusServer, promql: str, want: float) -> bool:
    return _value(prom, promql) == want


def _drive(stack: Stack, urls: dict[str, str], metrics: OperatorMetrics, pods: list[DiscoveredPod],
           base: float) -> None:
    """Traffic through both routers, and the autoscaler's decisions on what Prometheus then holds."""
    prom = stack.prom
    source = s.MetricsSource(type="prometheus", prometheus_url=prom.url,
                             selector=f'namespace="{NS}",resource="{RESOURCE}"')
    targets = [PodTarget(p.pod, p.labels["app.kubernetes.io/component"], f"http://{p.address}/metrics") for p in pods]
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
    wait_for(lambda: _scraped(prom, served, base + 6 + 100 * 4), 30, "the requests scraped", interval=0.2)
    state = PassState()
    for batch in (1, 2):
        if batch == 2:
            _complete(urls["router"], 3, stream=True)
            # the routers too: a scrape taken mid-request holds that request's hand-off as a pending send
            wait_for(lambda: _scraped(prom, served, base + 9 + 100 * 7)
                     and _scraped(prom, "sum(disagg:router_kv_pending_sends)", 0), 30, "the second batch scraped",
                     interval=0.2)
        outcome = run_pass(lambda: from_prometheus(targets, source, time.time), {}, CURRENT, POLICY, state,
                           time.time(), dry_run=True)
        state = outcome.state
        assert [smp.error for smp in outcome.samples] == [None] * len(targets)
        metrics.observe(NS, RESOURCE, outcome.decision)
        stack.decisions.append(outcome.decision)
        stack.statuses.append(scaling_status(outcome.decision, outcome.changes, {}, dry_run=True))
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


def test_the_status_names_the_signals_each_role_used(stack):
    """Read through Prometheus, vLLM pods get the KV back-pressure signal from the router pods' per-endpoint
    view (matched to the worker pod by endpoint_pod); what vLLM does not export is named unavailable."""
    status = stack.statuses[-1]
    prefill, decode = status["prefill"], status["decode"]
    assert {"waitingRequests", "timeToFirstToken", "pendingSends", "promptTokensRate"} <= set(prefill["signalsUsed"])
    assert {"kvCacheUsage", "interTokenLatency", "pendingLoads", "failedTransfers"} <= set(decode["signalsUsed"])
    if stack.engine == "vllm":
        assert prefill["signalsUnavailable"] == ["waitingPromptTokens"]
    else:
        assert "signalsUnavailable" not in prefill and "signalsUnavailable" not in decode
    assert stack.decisions[-1].metrics["prefill_pending_sends_per_pod"] == 0.0


def test_every_scraped_series_carries_role_and_resource_from_its_pod(stack):
    for label in ("role", "resource", "namespace", "pod"):
        unlabelled = stack.prom.query(f'count by (__name__) ({{__name__=~"(vllm|disagg):.+", {label}=""}})')
        assert unlabelled["data"]["result"] == [], (label, unlabelled)
    roles = stack.prom.query('count by (role, pod) (vllm:num_requests_running{resource="llama"})')["data"]["result"]
    assert {(r["metric"]["role"], r["metric"]["pod"]) for r in roles} == {("prefill", "llama-prefill-0"),
                                                                          ("decode", "llama-decode-0")}
    # our engine's own role label stays, as exported_role (honor_labels false); vLLM exports none
    own = stack.prom.query('count(vllm:num_requests_running{exported_role!=""})')["data"]["result"]
    assert bool(own) == (stack.engine == "disagg")


def test_every_dashboard_query_parses_names_exported_metrics_and_returns_series(stack):
    """Every query returns series, except one whose metrics the panel's description names as our engine's only
    (vLLM exports no such metric); every panel shows something."""
    exported = exported_metric_names()
    empty, dark, answered, total = [], [], 0, 0
    for panel in stack.dashboard["panels"]:
        shown = False
        for title, expr in dashboard_queries({"panels": [panel]}):
            names = set(METRIC_NAME.findall(expr))
            assert names <= exported, f"{title}: {expr}"
            answer = stack.prom.query(substitute(expr, VARIABLES))
            assert answer["status"] == "success", f"{title}: {expr}: {answer.get('error')}"
            shown = shown or bool(answer["data"]["result"])
            answered, total = answered + bool(answer["data"]["result"]), total + 1
            said = "our engine only" in panel.get("description", "") and all(
                n.removesuffix("_total") in panel["description"] for n in names)
            if not answer["data"]["result"] and not (stack.engine == "vllm" and said):
                empty.append(f"{title}: {expr}")
        if panel.get("targets") and not shown:
            dark.append(panel["title"])
    print(f"\n{stack.engine}: {answered} of {total} dashboard queries return series")
    assert not empty, "queries without series:\n" + "\n".join(empty)
    assert not dark, f"panels without series: {dark}"


def test_by_role_panels_tell_the_roles_apart(stack):
    for panel in stack.dashboard["panels"]:
        roles = set()
        for title, expr in dashboard_queries({"panels": [panel]}):
            if "by (role" not in expr:
                continue
            for series in stack.prom.query(substitute(expr, VARIABLES))["data"]["result"]:
                assert series["metric"].get("role") in ("prefill", "decode", "router"), (title, series)
                roles.add(series["metric"]["role"])
        if panel["title"] in BOTH_ROLES:
            assert {"prefill", "decode"} <= roles, (panel["title"], roles)


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
    deadline, now_active = time.monotonic() + 120, active()  # evaluation and scrapes lag on a loaded box (vLLM)
    while now_active != want and time.monotonic() < deadline:
        time.sleep(0.5)
        now_active = active()
    ratios = {q: stack.prom.query(q)["data"]["result"] for q in (
        "sum by (namespace, resource) (increase(disagg:router_decode_alone_total[5m]))",
        "sum by (namespace, resource) (increase(disagg:router_requests_total[5m]))")}
    assert now_active == want, ratios

