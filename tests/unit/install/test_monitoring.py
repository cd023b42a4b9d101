"""The chart's Grafana dashboard and alert rules, rendered by a real helm: sidecar provisioning, only exported
metric names, `promtool check rules`, `promtool test rules` (prometheus_rules_test.yaml) and a runbook per alert.
The same queries against a real Prometheus scraping real processes: tests/integration/install/test_monitoring_
prometheus.py."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from helm_cli import template  # tests/ is on sys.path (tests/conftest.py)
from prometheus_cli import (CHART, DASHBOARD, METRIC_NAME, alerts, binary, dashboard_queries, exported_metric_names,
                            load_dashboard, relabel_config, render_monitoring, render_worker_pod_monitor, sanitized,
                            write_rules_file)

HERE = Path(__file__).resolve().parent
PROMTOOL_MISSING = "promtool is not installed (Debian package prometheus; .ci/run installs it)"


@pytest.fixture(scope="module")
def helm_home(tmp_path_factory):
    return tmp_path_factory.mktemp("helm")


@pytest.fixture(scope="module")
def rendered(helm_home):
    return render_monitoring(helm_home)


def test_dashboard_and_rules_are_off_by_default(helm_home):
    docs = template(CHART, helm_home)
    assert not [d for d in docs if d["kind"] in ("ConfigMap", "PrometheusRule")]


def test_dashboard_configmap_is_labelled_for_the_grafana_sidecar(rendered, helm_home):
    cm, _ = rendered
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["namespace"] == "disagg-system"
    assert load_dashboard(cm) == json.loads(DASHBOARD.read_text())
    cm, _ = render_monitoring(helm_home, "--set", "monitoring.dashboards.namespace=grafana",
                              "--set", "monitoring.dashboards.annotations.grafana_folder=LLM")
    assert (cm["metadata"]["namespace"], cm["metadata"]["annotations"]) == ("grafana", {"grafana_folder": "LLM"})


def test_dashboard_queries_name_only_exported_metrics_and_defined_variables(rendered):
    dashboard = load_dashboard(rendered[0])
    exported = exported_metric_names()
    queries = dashboard_queries(dashboard)
    assert len(queries) >= 30
    defined = {v["name"] for v in dashboard["templating"]["list"]} | {"__rate_interval"}
    for title, expr in queries:
        names = set(METRIC_NAME.findall(expr))
        assert names, f"{title}: no metric in {expr}"
        assert names <= exported, f"{title}: {sorted(names - exported)} are not exported"
        assert set(re.findall(r"\$(\w+)", expr)) <= defined, f"{title}: undefined variable in {expr}"
        assert 'namespace=~"$namespace"' in expr, f"{title} ignores the namespace variable"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    # the panels, by the metrics behind them
    used = {n for _, e in queries for n in METRIC_NAME.findall(e)}
    for name in ("vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
                 "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc", "vllm:nixl_xfer_time_seconds_bucket",
                 "vllm:nixl_bytes_transferred_sum", "vllm:nixl_num_descriptors_sum",
                 "vllm:nixl_num_failed_transfers_total", "vllm:nixl_num_kv_expired_reqs_total",
                 "disagg:router_kv_pending_sends", "disagg:router_kv_pending_loads",
                 "disagg:router_kv_oldest_pending_send_seconds", "disagg:router_handoff_to_first_token_seconds_bucket",
                 "disagg:router_hop_latency_seconds_bucket",
                 "disagg:router_decode_alone_total", "disagg_operator_desired_replicas",
                 "disagg_operator_scaling_decisions_total", "disagg:router_held_requests",
                 "disagg:router_cold_start_seconds_bucket"):
        assert name in used, f"no panel shows {name}"


def test_alerts_name_only_exported_metrics_and_each_has_a_runbook(rendered):
    exported = exported_metric_names()
    readme = (CHART / "README.md").read_text()
    assert "\n## Alerts\n" in readme
    runbooks = readme.split("\n## Alerts\n", 1)[1].split("\n## ", 1)[0]
    for name, expr in alerts(rendered[1]).items():
        names = set(METRIC_NAME.findall(expr))
        assert names and names <= exported, f"{name}: {sorted(names - exported)} are not exported"
        assert f"`{name}`" in runbooks, f"{name} has no runbook in the chart README"


@pytest.mark.skipif(binary("promtool") is None, reason=PROMTOOL_MISSING)
def test_rendered_rules_pass_promtool_check(rendered, tmp_path):
    rules = write_rules_file(rendered[1], tmp_path / "rules.yaml")
    proc = subprocess.run([binary("promtool"), "check", "rules", rules], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(alerts(rendered[1]))} rules found" in proc.stdout


@pytest.mark.skipif(binary("promtool") is None, reason=PROMTOOL_MISSING)
def test_promtool_unit_tests_of_every_alert(rendered, tmp_path):
    write_rules_file(rendered[1], tmp_path / "rules.yaml")
    tests = shutil.copy(HERE / "prometheus_rules_test.yaml", tmp_path / "tests.yaml")
    tested = set(re.findall(r"alertname: (\w+)", Path(tests).read_text()))
    assert tested == set(alerts(rendered[1])), "every alert needs a promtool unit test"
    proc = subprocess.run([binary("promtool"), "test", "rules", tests], capture_output=True, text=True, timeout=60,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.skipif(binary("promtool") is None, reason=PROMTOOL_MISSING)
def test_promtool_unit_tests_fail_on_a_changed_threshold(helm_home, tmp_path):
    """The unit tests pin the default thresholds: a different one makes them fail (they can fail)."""
    _, rule = render_monitoring(helm_home, "--set-json", "monitoring.prometheusRule.decodeKVCacheUsage=0.99")
    write_rules_file(rule, tmp_path / "rules.yaml")
    tests = shutil.copy(HERE / "prometheus_rules_test.yaml", tmp_path / "tests.yaml")
    proc = subprocess.run([binary("promtool"), "test", "rules", tests], capture_output=True, text=True, timeout=60,
                          cwd=tmp_path)
    assert proc.returncode != 0 and "DisaggDecodeKVCacheSaturated" in proc.stdout + proc.stderr


def test_the_documented_scrape_job_labels_series_as_the_charts_pod_monitor(helm_home):
    """docs/observability.md's job for users with their own Prometheus keeps the operator's pods on port http and
    relabels role and resource exactly as the chart's PodMonitor does (Debian's promtool lacks Kubernetes
    discovery, so the job is compared, not loaded)."""
    docs = (HERE.parents[2] / "docs" / "observability.md").read_text()
    (block,) = re.findall(r"```yaml\n(scrape_configs:.*?)```", docs, re.S)
    (job,) = yaml.safe_load(block)["scrape_configs"]
    assert job["kubernetes_sd_configs"] == [{"role": "pod"}]
    monitor = render_worker_pod_monitor(helm_home)["spec"]
    endpoints = monitor["podMetricsEndpoints"]
    rules = job["relabel_configs"]
    for endpoint in endpoints:
        assert [relabel_config(r) for r in endpoint["relabelings"]] == [r for r in rules if r.get("target_label") in
                                                                       ("role", "resource")]
    keep = {r["source_labels"][0]: r["regex"] for r in rules if r.get("action") == "keep"}
    assert keep == {**{f"__meta_kubernetes_pod_label_{sanitized(k)}": v
                       for k, v in monitor["selector"]["matchLabels"].items()},
                    "__meta_kubernetes_pod_container_port_name": "|".join(e["port"] for e in endpoints)}
    assert {r.get("target_label") for r in rules} >= {"namespace", "pod", "role", "resource"}
