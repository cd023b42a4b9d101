"""LLMEngine: joins scheduler, worker (device, model, KV cache) and output processor; `step()` advances every
request one step."""
from __future__ import annotations

import logging
import time
from typing import Any

from disagg.worker.config import EngineConfig
from disagg.worker.engine.input_processor import InputProcessor
from disagg.worker.engine.kv_cache_manager import KVCacheManager
from disagg.worker.engine.output_processor import OutputProcessor
from disagg.worker.engine.parent_request import ParentRequests
from disagg.worker.engine.request import RequestStatus
from disagg.worker.engine.request_output import CompletionOutput, RequestOutput
from disagg.worker.engine.scheduler import Scheduler, SchedulerConfig
from disagg.worker.engine.stats import EngineSnapshot, EngineStats, QueueLoad, engine_snapshot, queue_load
from disagg.worker.kv_events.collector import KVEventCollector
from disagg.worker.kv_events.schema import EventBatch
from disagg.worker.kv_transfer.base import KVConnectorRole
from disagg.worker.kv_transfer.connectors import handoff_fields_of
from disagg.worker.kv_transfer.factory import create_connector
from disagg.worker.kv_transfer.handoff import Handoff
from disagg.worker.model import Tokenizer
from disagg.worker.outputs import SchedulerOutput
from disagg.worker.runner.worker import Worker
from disagg.worker.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

KV_WAIT_S = 0.001  # the longest idle wait for asynchronous KV between two steps


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.worker = Worker(config)  # device, model, KV cache, worker-role connector
        w = self.worker
        self.device, self.model, self.model_config, self.dtype = w.device, w.model, w.model_config, w.dtype
        self.runner, self.worker_connector, self.kv_cache_spec = w.model_runner, w.connector, w.kv_cache_spec
        self.max_model_len = w.max_model_len
        self.served_model_name = config.served_model_name
        self.tokenizer = Tokenizer(config.model)
        self.eos_token_ids = frozenset(self.model_config.eos_token_ids) | frozenset(self.tokenizer.eos_token_ids)
        ktc = config.kv_transfer_config
        self.scheduler_connector = create_connector(ktc, KVConnectorRole.SCHEDULER, self.kv_cache_spec)
        self.kv_events: KVEventCollector | None = None
        if config.enable_kv_events:
            self.kv_events = KVEventCollector(config.block_size, "GPU" if self.device.type == "cuda" else "CPU")
            self.kv_events.cleared()  # the first batch tells subscribers this engine starts empty
        num_blocks = self.kv_cache_spec.num_blocks
        self.kv_cache_manager = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching,
                                               events=self.kv_events)
        self.scheduler = Scheduler(SchedulerConfig(
            max_num_batched_tokens=max(config.max_num_batched_tokens, 1), max_num_seqs=config.max_num_seqs,
            max_model_len=self.max_model_len, enable_chunked_prefill=config.enable_chunked_prefill,
            kv_load_failure_policy=ktc.kv_load_failure_policy,
        ), self.kv_cache_manager, self.scheduler_connector)
        self.input_processor = InputProcessor(self.tokenizer, self.model_config.vocab_size, self.max_model_len,
                                              self.eos_token_ids, handoff_fields_of(ktc.kv_connector),
                                              self.scheduler_connector)
        self.stats = EngineStats()
        self._parents = ParentRequests()
        self.output_processor = OutputProcessor(self.tokenizer, self._parents, self.stats)
        self._next_id = 0
        logger.info(
            "engine ready: model=%s arch=%s dtype=%s device=%s kv_blocks=%d block_size=%d connector=%s",
            config.model, self.model_config.architecture, self.kv_cache_spec.dtype, self.device, num_blocks,
            config.block_size, ktc.kv_connector_module_path or ktc.kv_connector,
        )

    # ------------------------------------------------------------------ requests
    def add_request(
        self,
        prompt: str | list[int],
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        kv_transfer_params: Handoff | dict[str, Any] | None = None,
    ) -> str:
        """Validate and queue a request; raises ValueError naming what is wrong (nothing is queued).
        kv_transfer_params: the P/D hand-off, parsed or as JSON (vLLM's keys)."""
        sampling_params = sampling_params or SamplingParams()
        processed = self.input_processor.process(prompt, sampling_params, kv_transfer_params)
        if request_id is None:
            request_id = f"req-{self._next_id}"
            self._next_id += 1
        text = prompt if isinstance(prompt, str) else None
        for req in self._parents.make_requests(request_id, processed.token_ids, sampling_params, self.eos_token_ids,
                                               processed.handoff, processed.delivered):
            self.scheduler.add_request(req)
            self.output_processor.add_request(req, text)
        return request_id

    def abort_request(self, request_id: str) -> None:
        self.scheduler.finish_requests(self._parents.children_of(request_id), RequestStatus.FINISHED_ABORTED)

    def release_kv(self, request_id: str) -> bool:
        """Free the KV a finished prefill keeps for a reader who will not come (`request_id`: the hand-off's
        remote request id); False when none of that request waits here."""
        return self.scheduler_connector is not None and self.scheduler_connector.release(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def has_pending_kv_work(self) -> bool:
        return self.scheduler.has_pending_kv_work()

    def metrics_snapshot(self) -> EngineSnapshot:
        return engine_snapshot(self.scheduler, self.kv_cache_manager.usage(), self.scheduler_connector, self.stats)

    def queue_load(self) -> QueueLoad:
        """The waiting queue as admission weighs it (server/admission.py)."""
        return queue_load(self.scheduler)

    def compile_structured_output(self, sp: SamplingParams) -> None:
        """Compile sp's grammar now (thread-safe), so that adding the request does not compile it on the engine
        thread; ValueError when it does not compile."""
        self.input_processor.compile_structured_output(sp)

    def take_kv_connector_stats(self) -> list[dict[str, Any]]:
        """The connector's per-step stats since the last call, oldest first."""
        stats, self.stats.kv_connector_stats = self.stats.kv_connector_stats, []
        return stats

    def take_kv_events(self) -> EventBatch | None:
        """Prefix-cache changes since the last call (None: none, or events are off)."""
        return self.kv_events.take() if self.kv_events is not None else None

    # ------------------------------------------------------------------ step
    def step(self) -> list[RequestOutput]:
        so = self.scheduler.schedule()
        try:
            runner_output = self.worker.execute_model(so, self.kv_cache_manager.pool.high_water)
        except Exception as e:  # an engine bug: fail this batch, keep serving the rest
            logger.exception("model step failed; failing the %d scheduled requests", len(so.num_scheduled_tokens))
            return self._fail_step(so, e)
        core_outputs = self.scheduler.update_from_output(so, runner_output)
        kvo = runner_output.kv_connector_output
        if kvo is not None and kvo.kv_connector_stats:
            self.stats.kv_connector_stats.append(kvo.kv_connector_stats)
        return self.output_processor.process_outputs(core_outputs, self._finish_stopped)

    def step_or_wait(self, wait_s: float = KV_WAIT_S) -> list[RequestOutput]:
        """step(), and when it gave nothing while no remote KV has landed (only asynchronous KV work is pending),
        wait up to wait_s for KV progress instead of spinning: the idle wait of every loop that drives the engine
        (the server's engine thread, LLM.generate). Not when KV has just landed: the next step admits that request.
        The wait ends early when the connector sees a load finish; a plain sleep (1 ms asked, often several on a
        busy machine) went straight into that request's time to first token."""
        outputs = self.step()
        if not outputs and not self.scheduler.has_landed_remote_kv():
            if self.worker_connector is not None:
                self.worker_connector.wait_for_kv_progress(wait_s)
            else:
                time.sleep(wait_s)
        return outputs

    def _fail_step(self, so: SchedulerOutput, error: Exception) -> list[RequestOutput]:
        req_ids = list(so.num_scheduled_tokens)
        self.scheduler.finish_requests(req_ids, RequestStatus.FINISHED_ERROR, f"engine step failed: {error}")
        return self.output_processor.process_outputs(self.scheduler.take_pending_outputs(), self._finish_stopped)

    def _finish_stopped(self, req_id: str) -> dict[str, Any] | None:
        """A stop string ended the request: finish it in the scheduler; its hand-off for the decode side."""
        req = self.scheduler.requests.get(req_id)
        self.scheduler.finish_requests(req_id, RequestStatus.FINISHED_STOPPED)
        handoff = req.kv_transfer_params if req is not None else None
        return handoff.to_wire() if handoff is not None else None

    def shutdown(self) -> None:
        self.worker.shutdown()
        if self.scheduler_connector is not None:
            self.scheduler_connector.shutdown()


__all__ = ["LLMEngine", "RequestOutput", "CompletionOutput"]
