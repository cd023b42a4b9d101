"""Runs one scheduled step on the model: the only layer that touches tensors and devices.

The forward pass (and anything else that writes KV in the step) runs inside the KV-connector
lifecycle context (kv_transfer/lifecycle.py), whose output rides back in ModelRunnerOutput.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from disagg.worker.forward_context import AttentionMetadata, ForwardContext, set_forward_context
from disagg.worker.kv_transfer.base import KVConnectorBase
from disagg.worker.kv_transfer.lifecycle import kv_connector_step
from disagg.worker.outputs import ModelRunnerOutput, SchedulerOutput
from disagg.worker.runner.logprobs import prompt_logprobs_for_step
from disagg.worker.runner.sampler import SamplingBatch, sample_batch
from disagg.worker.sampling_params import SamplingParams
from disagg.worker.runner.grammar_mask import new_matcher

logger = logging.getLogger(__name__)


@dataclass
class CachedRequestState:
    req_id: str
    token_ids: list[int]  # prompt (+ tokens generated before a preemption) + tokens sampled here
    block_ids: list[int]  # block table
    num_computed_tokens: int  # KV in cache before the current step
    sampling_params: SamplingParams
    generator: torch.Generator | None = field(default=None, repr=False)  # its own seed's; None: the engine's
    num_prompt_tokens: int = 0  # token_ids[:num_prompt_tokens] is the prompt (penalties, prompt logprobs)
    matcher: Any = field(default=None, repr=False)  # structured output's grammar matcher, or None
    forced_output_ids: tuple[int, ...] = ()  # outputs chosen by the prefill engine (Request.forced_output_ids)

    def forced_next(self) -> int | None:
        """The next output token if it is forced, else None."""
        k = len(self.token_ids) - self.num_prompt_tokens
        return self.forced_output_ids[k] if k < len(self.forced_output_ids) else None


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_cache: torch.Tensor,
        block_size: int,
        device: torch.device,
        connector: KVConnectorBase | None = None,
        seed: int = 0,
    ):
        self.model = model
        self.kv_cache = kv_cache  # (num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim)
        self.block_size = block_size
        self.device = device
        self.connector = connector  # worker-role connector (runner/worker.py registered the cache with it) or None
        self.requests: dict[str, CachedRequestState] = {}
        # draws for requests without their own seed: the same seed and workload sample the same text
        self.generator = torch.Generator(device=device).manual_seed(seed)

    # ------------------------------------------------------------------ state
    def _update_states(self, so: SchedulerOutput) -> None:
        for req_id in so.finished_req_ids | so.preempted_req_ids:
            self.requests.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            gen = None
            if new.sampling_params.seed is not None:
                gen = torch.Generator(device=self.device).manual_seed(new.sampling_params.seed)
            num_prompt = len(new.prompt_token_ids) if new.num_prompt_tokens is None else new.num_prompt_tokens
            # after a preemption the matcher replays the tokens generated before it
            matcher = new_matcher(new.sampling_params, new.prompt_token_ids[num_prompt:])
            self.requests[new.req_id] = CachedRequestState(
                new.req_id, list(new.prompt_token_ids), list(new.block_ids), new.num_computed_tokens,
                new.sampling_params, gen, num_prompt, matcher, tuple(new.forced_output_ids),
            )
        for cached in so.scheduled_cached_reqs:
            state = self.requests[cached.req_id]
            state.block_ids.extend(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens

    # ------------------------------------------------------------------ step
    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(so)
        if so.total_num_scheduled_tokens == 0:
            # nothing to compute, but finished transfers must still surface
            with kv_connector_step(self.connector, so, wait_for_save=False) as kv_output:
                pass
            return ModelRunnerOutput.empty(kv_output)

        # decodes (one new token) first, then prefill chunks; ties keep scheduler order
        req_ids = sorted(so.num_scheduled_tokens, key=lambda r: so.num_scheduled_tokens[r] != 1)
        input_ids, positions, attn_metadata, sample_rows = self._prepare_inputs(req_ids, so.num_scheduled_tokens)
        ctx = ForwardContext(attn_metadata=attn_metadata, kv_cache=self.kv_cache, kv_connector=self.connector,
                             extra={})  # layers cache per-step index tensors here
        with kv_connector_step(self.connector, so) as kv_output:
            with set_forward_context(ctx):
                hidden = self.model(input_ids, positions)
            out = ModelRunnerOutput(req_ids=req_ids, sampled_token_ids={r: [] for r in req_ids},
                                    kv_connector_output=kv_output)
            if self._wants_prompt_logprobs:
                out.prompt_logprobs = prompt_logprobs_for_step(self.model, hidden, req_ids, so.num_scheduled_tokens,
                                                               attn_metadata.query_start_loc, self.requests)
            if sample_rows:
                rows = torch.tensor([row for _, row in sample_rows], device=self.device)
                logits = self.model.compute_logits(hidden.index_select(0, rows))
                self._sample(logits, [self.requests[r] for r, _ in sample_rows], out)
        return out

    def _sample(self, logits: torch.Tensor, states: list[CachedRequestState], out: ModelRunnerOutput) -> None:
        batch = SamplingBatch(
            [s.sampling_params for s in states], [s.generator or self.generator for s in states],
            [s.token_ids for s in states], [s.num_prompt_tokens for s in states],
            [s.matcher for s in states] if any(s.matcher is not None for s in states) else [],
            [s.req_id for s in states],
            [s.forced_next() for s in states] if any(s.forced_output_ids for s in states) else [])
        token_ids, logprobs = sample_batch(logits, batch)
        for state, token_id, lp in zip(states, token_ids, logprobs):
            state.token_ids.append(token_id)
            out.sampled_token_ids[state.req_id] = [token_id]
            if lp is not None:
                out.logprobs[state.req_id] = [lp]

    @property
    def _wants_prompt_logprobs(self) -> bool:
        return any(s.sampling_params.prompt_logprobs is not None for s in self.requests.values())

    def _prepare_inputs(
        self, req_ids: list[str], num_scheduled: dict[str, int]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[tuple[str, int]]]:
        # The step's index arrays are built in numpy and handed to torch without a copy: torch.tensor() of
        # Python lists converted ~100 ns per element - on a P/D decode worker at 2k-token contexts the block
        # tables alone took ~12% of the engine thread's samples.
        bs = self.block_size
        T = sum(num_scheduled[r] for r in req_ids)
        ids = np.empty(T, dtype=np.int64)
        pos = np.empty(T, dtype=np.int64)
        slots = np.empty(T, dtype=np.int64)
        query_start_loc = [0]
        seq_lens: list[int] = []
        sample_rows: list[tuple[str, int]] = []  # (req_id, row of its last new token)
        for r in req_ids:
            state, n = self.requests[r], num_scheduled[r]
            start, q0 = state.num_computed_tokens, query_start_loc[-1]
            end = start + n
            if n == 1:  # a decode: no arrays for one token
                ids[q0] = state.token_ids[start]
                pos[q0] = start
                slots[q0] = state.block_ids[start // bs] * bs + start % bs
            else:
                ids[q0:q0 + n] = state.token_ids[start:end]
                p = np.arange(start, end, dtype=np.int64)
                pos[q0:q0 + n] = p
                table = np.asarray(state.block_ids[start // bs:(end - 1) // bs + 1], dtype=np.int64)
                slots[q0:q0 + n] = table[p // bs - start // bs] * bs + p % bs
            query_start_loc.append(q0 + n)
            seq_lens.append(end)
            if end >= len(state.token_ids):  # prompt (chunk) complete: sample the next token
                sample_rows.append((r, q0 + n - 1))
        max_blocks = max(-(-s // bs) for s in seq_lens)
        tables = np.zeros((len(req_ids), max_blocks), dtype=np.int64)
        for i, r in enumerate(req_ids):
            row = self.requests[r].block_ids[:max_blocks]
            tables[i, :len(row)] = row
        dev = self.device
        meta = AttentionMetadata(
            num_decodes=sum(1 for r in req_ids if num_scheduled[r] == 1),
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            seq_lens_tensor=_to(np.asarray(seq_lens, dtype=np.int64), dev),
            block_tables=_to(tables, dev),
            slot_mapping=_to(slots, dev),
            block_size=bs,
        )
        return _to(ids, dev), _to(pos, dev), meta, sample_rows


def _to(a: np.ndarray, device: torch.device) -> torch.Tensor:
    """An int64 numpy array as a tensor on device: shared memory on CPU, one copy elsewhere."""
    t = torch.from_numpy(a)
    return t if device.type == "cpu" else t.to(device)
