"""The worker's metric names live in disagg.worker.metric_names: every name there that the worker exports appears in
its /metrics text, with the labels the router and the autoscaler select on."""
from __future__ import annotations

from disagg.worker import metric_names
from disagg.worker.server.metrics import WorkerMetrics

NOT_OURS = {metric_names.VLLM_KV_FETCH_BY_STAGE}  # vLLM's decode workers export it; the autoscaler reads it there


def test_every_declared_worker_metric_name_is_exported_with_model_and_role_labels():
    text = WorkerMetrics("m", "decode").render().decode()
    names = {v for k, v in vars(metric_names).items() if k.isupper() and isinstance(v, str)} - NOT_OURS
    assert len(names) == 23
    for name in names:
        assert f'# HELP {name}' in text, name
        assert any(line.startswith(name) and 'model_name="m"' in line and 'role="decode"' in line
                   for line in text.splitlines()), name
