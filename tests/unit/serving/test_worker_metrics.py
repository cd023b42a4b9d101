"""The worker's metrics: every name in disagg.worker.metric_names that the worker exports appears in its /metrics
text, with the labels the router and the autoscaler select on; a connector's declared metrics are registered and
fed by its stats."""
from __future__ import annotations

import asyncio

import httpx
import pytest
from stats_connector import StatsConnector

from disagg.worker import metric_names
from disagg.worker.config import EngineConfig
from disagg.worker.engine.llm_engine import LLMEngine
from disagg.worker.kv_transfer.base import ConnectorMetric, KVTransferConfig, kv_bytes_loaded
from disagg.worker.server.app import ServerState, build_app
from disagg.worker.server.engine_loop import EngineLoop
from disagg.worker.server.metrics import WorkerMetrics, worker_metrics

NOT_OURS = {metric_names.VLLM_KV_FETCH_BY_STAGE}  # vLLM's decode workers export it; the autoscaler reads it there


def test_every_declared_worker_metric_name_is_exported_with_model_and_role_labels():
    text = WorkerMetrics("m", "decode").render().decode()
    names = {v for k, v in vars(metric_names).items() if k.isupper() and isinstance(v, str)} - NOT_OURS
    assert len(names) == 26
    for name in names:
        assert f'# HELP {name}' in text, name
        assert any(line.startswith(name) and 'model_name="m"' in line and 'role="decode"' in line
                   for line in text.splitlines()), name


def sample(metrics: WorkerMetrics, name: str) -> float:
    return metrics.registry.get_sample_value(name, {"model_name": "m", "role": "decode"}) or 0.0


def test_a_connector_metric_is_fed_by_its_stats_key_only():
    declared = StatsConnector.metrics + (kv_bytes_loaded("bytes_loaded"),)
    m = WorkerMetrics("m", "decode", declared)
    m.observe_connector_stats({"steps": 1, "step_tokens": [3, 40], "bytes_loaded": 0, "bytes": [100]})
    m.observe_connector_stats({"steps": 2, "step_tokens": [], "bytes_loaded": 7})
    assert sample(m, "disagg:test_connector_steps_total") == 3
    assert sample(m, "disagg:test_connector_step_tokens_count") == 2
    assert sample(m, "disagg:test_connector_step_tokens_bucket") == 0  # no label le: not a sample
    assert m.registry.get_sample_value("disagg:test_connector_step_tokens_bucket",
                                       {"model_name": "m", "role": "decode", "le": "4.0"}) == 1
    assert sample(m, "disagg:kv_bytes_loaded_total") == 7  # "bytes" feeds it only for connectors declaring so


def test_one_metric_declared_two_ways_is_refused_by_name():
    a = ConnectorMetric("disagg:x", "counter", "X.", "a")
    with pytest.raises(ValueError, match="disagg:x is declared twice"):
        WorkerMetrics("m", "decode", (a, ConnectorMetric("disagg:x", "histogram", "X.", "b")))
    WorkerMetrics("m", "decode", (a, ConnectorMetric("disagg:x", "counter", "X.", "b")))  # two keys, one metric


@pytest.mark.asyncio
async def test_the_loaded_connectors_declared_metrics_appear_in_the_workers_metrics(tiny_model_dir):
    ktc = KVTransferConfig(kv_connector_module_path="stats_connector:StatsConnector")
    config = EngineConfig(model=tiny_model_dir, served_model_name="tiny", dtype="float32", max_model_len=128,
                          num_kv_blocks=32, kv_transfer_config=ktc)
    loop = EngineLoop(lambda: LLMEngine(config), lambda engine: worker_metrics(engine, "decode"))
    loop.start(asyncio.get_running_loop())
    try:
        assert await asyncio.to_thread(loop.loaded.wait, 120) and loop.ready, loop.load_error
        async with httpx.AsyncClient(transport=httpx.ASGITransport(build_app(ServerState(loop, "decode"))),
                                     base_url="http://worker") as client:
            r = await client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3})
            assert r.status_code == 200, r.text
            text = (await client.get("/metrics")).text
    finally:
        await asyncio.to_thread(loop.stop)
    labels = '{model_name="tiny",role="decode"}'
    steps = [line for line in text.splitlines() if line.startswith(f"disagg:test_connector_steps_total{labels}")]
    assert steps and float(steps[0].split()[-1]) > 0  # fed by the steps of the request
    assert "# TYPE disagg:test_connector_step_tokens histogram" in text
    assert f"vllm:nixl_xfer_time_seconds_count{labels}" in text  # the built-in connectors' metrics stay exported
