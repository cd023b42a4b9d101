"""An out-of-tree connector for tests, loaded by module path: records every worker-side call.

Requests whose kv_transfer_params carry {"fake_remote": True} take the asynchronous-load path:
blocks are allocated, nothing is written into them, and after `load_steps` steps the load is
reported finished - with its blocks invalid when {"fail": True} (so the engine must recompute)."""
from __future__ import annotations

from disagg.worker.kv_transfer.base import KVConnectorBase

CALLS: list[tuple] = []  # shared by the two roles of the engine under test


class RecordingConnector(KVConnectorBase):
    load_steps = 2

    def __init__(self, config, role, kv_cache_spec):
        super().__init__(config, role, kv_cache_spec)
        self.loads: dict[str, tuple[list[int], bool]] = {}
        self.in_flight: dict[str, list] = {}  # worker side: req_id -> [steps left, blocks, fail]
        self.errors: set[int] = set()  # worker side: blocks of the loads that failed in the last get_finished

    # scheduler role
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        params = request.kv_transfer_params or {}
        if params.get("fake_remote"):
            return request.num_prompt_tokens - num_computed_tokens, True
        return 0, False

    def update_state_after_alloc(self, request, block_ids, num_external_tokens):
        if num_external_tokens:
            self.loads[request.request_id] = (list(block_ids), bool(request.kv_transfer_params.get("fail")))

    def build_connector_meta(self, scheduler_output):
        meta, self.loads = {"loads": self.loads, "step_tokens": scheduler_output.total_num_scheduled_tokens}, {}
        return meta

    # worker role
    def bind_connector_metadata(self, connector_metadata):
        CALLS.append(("bind", connector_metadata["step_tokens"]))
        super().bind_connector_metadata(connector_metadata)

    def start_load_kv(self, **kwargs):
        CALLS.append(("start_load_kv",))
        for req_id, (blocks, fail) in self._get_connector_metadata()["loads"].items():
            self.in_flight[req_id] = [self.load_steps, blocks, fail]

    def wait_for_layer_load(self, layer_name):
        CALLS.append(("wait_for_layer_load", layer_name))

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        CALLS.append(("save_kv_layer", layer_name))

    def wait_for_save(self):
        CALLS.append(("wait_for_save",))

    def get_finished(self, finished_req_ids):
        CALLS.append(("get_finished", frozenset(finished_req_ids)))
        done = set()
        self.errors = set()
        for req_id, entry in list(self.in_flight.items()):
            entry[0] -= 1
            if entry[0] <= 0:
                done.add(req_id)
                if entry[2]:
                    self.errors.update(entry[1])
                del self.in_flight[req_id]
        return None, done or None

    def get_block_ids_with_load_errors(self):
        CALLS.append(("get_block_ids_with_load_errors",))
        return self.errors

    def get_kv_connector_stats(self):
        CALLS.append(("get_kv_connector_stats",))
        return None

    def clear_connector_metadata(self):
        CALLS.append(("clear",))
        super().clear_connector_metadata()
