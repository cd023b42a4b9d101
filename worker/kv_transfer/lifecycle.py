"""The one place the worker-side KV-connector lifecycle of a step lives.

bind metadata -> start_load_kv -> (forward passes, layers call wait_for_layer_load/save_kv_layer)
-> finally: wait_for_save, get_finished, load errors, stats, clear metadata.

Clearing happens on exit of this context, so every forward that saves KV in the step (a draft
model's too) must run inside it.
"""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

from disagg.worker.kv_transfer.base import KVConnectorBase
from disagg.worker.outputs import KVConnectorOutput, SchedulerOutput

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def kv_connector_step(
    connector: KVConnectorBase | None, scheduler_output: SchedulerOutput, *, wait_for_save: bool = True
) -> Iterator[KVConnectorOutput | None]:
    """Yields the step's KVConnectorOutput (filled on exit), or None without a connector.

    wait_for_save=False for a step with nothing scheduled: no forward ran, nothing to save,
    but finished transfers must still surface."""
    if connector is None:
        yield None
        return
    output = KVConnectorOutput()
    connector.bind_connector_metadata(scheduler_output.kv_connector_metadata)
    try:
        connector.start_load_kv()
        yield output
    finally:
        try:
            if wait_for_save:
                connector.wait_for_save()
            output.finished_sending, output.finished_recving = connector.get_finished(
                scheduler_output.finished_req_ids
            )
            output.invalid_block_ids = set(connector.get_block_ids_with_load_errors())
            output.kv_connector_stats = connector.get_kv_connector_stats()
        finally:
            connector.clear_connector_metadata()
