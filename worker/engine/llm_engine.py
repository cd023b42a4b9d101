"""LLMEngine: joins scheduler, model runner and detokenizer; `step()` advances every request one step."""
from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from disagg.worker.engine.config import EngineConfig
from disagg.worker.engine.kv_cache_manager import KVCacheManager, cdiv
from disagg.worker.engine.request import Request, RequestStatus
from disagg.worker.engine.scheduler import Scheduler, SchedulerConfig
from disagg.worker.kv_events.collector import KVEventCollector
from disagg.worker.kv_events.schema import EventBatch
from disagg.worker.runner.host_malloc import tune_malloc
from disagg.worker.runner.kv_cache_memory import KVPrefaulter, allocate_kv_cache, is_lazy_mapping
from disagg.worker.kv_transfer.base import KVCacheSpec, KVConnectorRole
from disagg.worker.kv_transfer.connectors import handoff_fields_of
from disagg.worker.kv_transfer.factory import create_connector
from disagg.worker.kv_transfer.handoff import Handoff
from disagg.worker.model import Tokenizer, load_model
from disagg.worker.runner.model_runner import ModelRunner
from disagg.worker.outputs import EngineCoreOutput, SchedulerOutput
from disagg.worker.engine.request_output import CompletionOutput, OutputProcessor, RequestOutput
from disagg.worker.engine.parent_request import ParentRequests
from disagg.worker.sampling_params import SamplingParams
from disagg.worker.engine.structured_output import GrammarCompiler

logger = logging.getLogger(__name__)



def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={name!r} but CUDA is not available")
    return device


@dataclass
class EngineStats:
    """Counters since start (for Prometheus)."""

    prompt_tokens: int = 0  # prompt tokens of requests that produced their first token
    generation_tokens: int = 0
    # per step; readers drain it (the server's loop into metrics, LLM.generate at each call)
    kv_connector_stats: list[dict[str, Any]] = field(default_factory=list)


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.device = resolve_device(config.device)
        self.model, self.model_config = load_model(config.model, dtype=config.dtype, device=self.device)
        self.dtype = next(self.model.parameters()).dtype
        if self.device.type == "cpu":
            tune_malloc()
            if self.dtype == torch.float32 and hasattr(self.model, "pack_weights"):
                logger.info("packed %d linear weights for oneDNN", self.model.pack_weights())
        self.tokenizer = Tokenizer(config.model)
        self.served_model_name = config.served_model_name or Path(config.model).name
        mc = self.model_config
        self.max_model_len = config.max_model_len or mc.max_position_embeddings
        if self.max_model_len > mc.max_position_embeddings:
            raise ValueError(
                f"max_model_len={self.max_model_len} exceeds the model's max_position_embeddings="
                f"{mc.max_position_embeddings}"
            )
        self.eos_token_ids = frozenset(mc.eos_token_ids) | frozenset(self.tokenizer.eos_token_ids)
        dtype_name = str(self.dtype).removeprefix("torch.")
        spec = KVCacheSpec(
            model_name=self.served_model_name, num_layers=mc.num_hidden_layers, num_kv_heads=mc.num_key_value_heads,
            head_dim=mc.head_dim, block_size=config.block_size, num_blocks=0, dtype=dtype_name,
        )
        num_blocks = self._num_kv_blocks(spec.bytes_per_block)
        self.kv_cache_spec = dataclasses.replace(spec, num_blocks=num_blocks)
        kv_cache = allocate_kv_cache(
            (num_blocks, mc.num_hidden_layers, 2, config.block_size, mc.num_key_value_heads, mc.head_dim),
            self.dtype, self.device,
        )
        ktc = config.kv_transfer_config
        self.scheduler_connector = create_connector(ktc, KVConnectorRole.SCHEDULER, self.kv_cache_spec)
        self.worker_connector = create_connector(ktc, KVConnectorRole.WORKER, self.kv_cache_spec)
        self.kv_events: KVEventCollector | None = None
        if config.enable_kv_events:
            self.kv_events = KVEventCollector(config.block_size, "GPU" if self.device.type == "cuda" else "CPU")
            self.kv_events.cleared()  # the first batch tells subscribers this engine starts empty
        self.kv_cache_manager = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching,
                                               events=self.kv_events)
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_batched_tokens=max(config.max_num_batched_tokens, 1),
                max_num_seqs=config.max_num_seqs,
                max_model_len=self.max_model_len,
                enable_chunked_prefill=config.enable_chunked_prefill,
                kv_load_failure_policy=ktc.kv_load_failure_policy,
            ),
            self.kv_cache_manager,
            self.scheduler_connector,
        )
        self.runner = ModelRunner(self.model, kv_cache, config.block_size, self.device, self.worker_connector,
                                  seed=config.seed)
        # a lazily mapped CPU cache: keep the blocks about to be used populated (see kv_cache_memory.py)
        self._prefaulter = KVPrefaulter(kv_cache, num_blocks) if is_lazy_mapping(kv_cache) else None
        self.output_processor = OutputProcessor(self.tokenizer)
        self.stats = EngineStats()
        self._next_id = 0
        self._parents = ParentRequests()
        self._grammars: GrammarCompiler | None = None  # built at the first structured-output request
        logger.info(
            "engine ready: model=%s arch=%s dtype=%s device=%s kv_blocks=%d block_size=%d connector=%s",
            config.model, mc.architecture, dtype_name, self.device, num_blocks, config.block_size,
            ktc.kv_connector_module_path or ktc.kv_connector,
        )

    def _num_kv_blocks(self, per_block: int) -> int:
        cfg = self.config
        min_blocks = cdiv(self.max_model_len, cfg.block_size)
        if cfg.num_kv_blocks is not None:
            if cfg.num_kv_blocks < min_blocks:
                raise ValueError(
                    f"num_kv_blocks={cfg.num_kv_blocks} cannot hold one max_model_len={self.max_model_len} "
                    f"request (needs {min_blocks})"
                )
            return cfg.num_kv_blocks
        budget = cfg.kv_cache_memory_bytes
        if budget is None:
            if self.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(self.device)
                budget = int(free * cfg.gpu_memory_utilization)
            else:
                budget = 1 << 30
        return max(budget // per_block, min_blocks)

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
        sampling_params.validate()
        if isinstance(prompt, str):
            token_ids = self.tokenizer.encode(prompt)
        else:
            token_ids = list(prompt)
            bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < self.model_config.vocab_size]
            if bad:
                raise ValueError(
                    f"prompt token ids {bad[:5]} are outside the vocabulary [0, {self.model_config.vocab_size})"
                )
        if not token_ids:
            raise ValueError("prompt is empty")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(token_ids)} tokens; max_model_len is {self.max_model_len} "
                "(prompt plus at least one new token must fit)"
            )
        handoff = None
        if kv_transfer_params is not None:
            handoff = Handoff.parse(kv_transfer_params, handoff_fields_of(self.config.kv_transfer_config.kv_connector))
            if self.scheduler_connector is not None:
                self.scheduler_connector.validate_kv_transfer_params(token_ids, handoff)
        self._check_sampling(sampling_params, handoff)
        delivered = self._delivered_tokens(sampling_params, handoff)
        if request_id is None:
            request_id = f"req-{self._next_id}"
            self._next_id += 1
        text = prompt if isinstance(prompt, str) else None
        if sampling_params.n == 1:
            req = Request(request_id, token_ids, sampling_params, self.eos_token_ids, handoff)
            req.forced_output_ids = delivered
            self._add(req, text)
            return request_id
        parent = self._parents.add(request_id, sampling_params.n)
        for i in range(sampling_params.n):
            req = Request(parent.child_id(i), token_ids, parent.child_params(sampling_params, i), self.eos_token_ids,
                          handoff if i == 0 else None)
            req.wait_for = parent.child_id(0) if i else None
            self._add(req, text)
        return request_id

    def _add(self, req: Request, prompt: str | None) -> None:
        self.scheduler.add_request(req)
        self.output_processor.add_request(req, prompt)

    def _check_sampling(self, sp: SamplingParams, handoff: Handoff | None) -> None:
        """What only the engine can check (vocabulary, grammar); compiles the structured output."""
        vocab = self.model_config.vocab_size
        bad = [t for t in [*sp.logit_bias, *sp.stop_token_ids] if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"logit_bias / stop_token_ids: token ids {bad[:5]} are outside the vocabulary "
                             f"[0, {vocab})")
        if sp.n > 1 and handoff is not None and handoff.is_prefill_hop:
            raise ValueError("n must be 1 on a prefill hop (do_remote_decode): the decode worker forks the choices")
        sp.eos_token_ids = self.eos_token_ids
        if sp.structured_output is not None and sp.structured_output.compiled is None:
            if self._grammars is None:
                self._grammars = GrammarCompiler(self.tokenizer, vocab, sorted(self.eos_token_ids))
            sp.structured_output.compiled = self._grammars.compile(sp.structured_output)

    def _delivered_tokens(self, sp: SamplingParams, handoff: Handoff | None) -> tuple[int, ...]:
        """kv_transfer_params.delivered_token_ids: the first output tokens, which the prefill engine chose and a
        router already streamed to the client (its output_token_ids); this engine continues after them."""
        ids = handoff.delivered_token_ids if handoff is not None else ()
        if not ids:
            return ()
        vocab = self.model_config.vocab_size
        if not all(t < vocab for t in ids):
            raise ValueError(f"kv_transfer_params.delivered_token_ids must be a non-empty list of token ids in "
                             f"[0, {vocab}), got {list(ids)!r:.80}")
        if sp.n != 1:
            raise ValueError("kv_transfer_params.delivered_token_ids needs n == 1 (one choice was delivered)")
        if len(ids) > sp.max_tokens:
            raise ValueError(f"kv_transfer_params.delivered_token_ids has {len(ids)} tokens, more than max_tokens "
                             f"({sp.max_tokens})")
        return tuple(ids)

    def abort_request(self, request_id: str) -> None:
        self.scheduler.finish_requests(self._parents.children_of(request_id), RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def has_pending_kv_work(self) -> bool:
        return self.scheduler.has_pending_kv_work()

    def wait_for_kv_progress(self, timeout: float) -> None:
        """Idle wait while only asynchronous KV work is pending (see KVConnectorBase.wait_for_kv_progress)."""
        if self.worker_connector is not None:
            self.worker_connector.wait_for_kv_progress(timeout)
        else:
            time.sleep(timeout)

    def take_kv_events(self) -> EventBatch | None:
        """Prefix-cache changes since the last call (None: none, or events are off)."""
        return self.kv_events.take() if self.kv_events is not None else None

    # ------------------------------------------------------------------ step
    def step(self) -> list[RequestOutput]:
        so = self.scheduler.schedule()
        if self._prefaulter is not None:
            self._prefaulter.advance(self.kv_cache_manager.pool.high_water)
        try:
            runner_output = self.runner.execute_model(so)
        except Exception as e:  # an engine bug: fail this batch, keep serving the rest
            logger.exception("model step failed; failing the %d scheduled requests", len(so.num_scheduled_tokens))
            return self._fail_step(so, e)
        core_outputs = self.scheduler.update_from_output(so, runner_output)
        kvo = runner_output.kv_connector_output
        if kvo is not None and kvo.kv_connector_stats:
            self.stats.kv_connector_stats.append(kvo.kv_connector_stats)
        return self._process(core_outputs)

    def _fail_step(self, so: SchedulerOutput, error: Exception) -> list[RequestOutput]:
        req_ids = list(so.num_scheduled_tokens)
        self.scheduler.finish_requests(req_ids, RequestStatus.FINISHED_ERROR, f"engine step failed: {error}")
        return self._process(self.scheduler.take_pending_outputs())

    def _process(self, core_outputs: list[EngineCoreOutput]) -> list[RequestOutput]:
        outputs = []
        for out in core_outputs:
            self.stats.generation_tokens += len(out.new_token_ids)
            ro = self.output_processor.process(out)
            if ro is None:
                continue
            if ro.finished and out.finish_reason is None:  # stopped by a stop string
                req = self.scheduler.requests.get(out.req_id)
                self.scheduler.finish_requests(out.req_id, RequestStatus.FINISHED_STOPPED)
                handoff = req.kv_transfer_params if req is not None else None
                ro.kv_transfer_params = handoff.to_wire() if handoff is not None else None
            ro.request_id, ro.outputs[0].index, ro.finished = self._parents.resolve(out.req_id, ro.finished)
            if (out.new_token_ids and len(ro.outputs[0].token_ids) == len(out.new_token_ids)
                    and ro.outputs[0].index == 0):
                self.stats.prompt_tokens += len(ro.prompt_token_ids)  # counted at its first token, as vLLM
            outputs.append(ro)
        return outputs

    def shutdown(self) -> None:
        if self._prefaulter is not None:
            self._prefaulter.stop()
        for connector in (self.worker_connector, self.scheduler_connector):
            if connector is not None:
                connector.shutdown()


__all__ = ["LLMEngine", "RequestOutput", "CompletionOutput"]
