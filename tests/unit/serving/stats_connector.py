"""An out-of-tree connector for tests, loaded by module path: moves no KV, but reports stats each step and
declares the metrics they feed, as a connector with metrics of its own does."""
from __future__ import annotations

from disagg.worker.kv_transfer.base import ConnectorMetric, KVConnectorBase


class StatsConnector(KVConnectorBase):
    metrics = (
        ConnectorMetric("disagg:test_connector_steps", "counter", "Steps the test connector saw.", "steps"),
        ConnectorMetric("disagg:test_connector_step_tokens", "histogram", "Tokens scheduled per step.",
                        "step_tokens", (1.0, 4.0, 16.0, 64.0)),
    )

    # scheduler role: no external KV
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return 0, False

    def update_state_after_alloc(self, request, block_ids, num_external_tokens):
        pass

    def build_connector_meta(self, scheduler_output):
        return scheduler_output.total_num_scheduled_tokens

    # worker role
    def get_kv_connector_stats(self):
        return {"steps": 1, "step_tokens": [self._get_connector_metadata()]}
