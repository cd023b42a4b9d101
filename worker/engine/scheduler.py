"""Continuous-batching scheduler (pure CPU, no torch).

Over 300 lines: one class holding the queues and their invariants (running, waiting, delayed frees,
aborted loads); splitting the step's phases into modules would spread those invariants apart.

Each step: keep running requests going (decode, or the next chunk of a prefill), preempting the
newest by recompute when blocks run out; then admit waiting requests under the token budget,
taking prefix-cache hits and external KV (from the connector) into account. Requests whose KV
arrives asynchronously wait in WAITING_FOR_REMOTE_KVS until the connector reports them loaded.
"""
from __future__ import annotations

import enum
import logging
from collections import deque
from dataclasses import dataclass
from typing import Any

from disagg.worker.engine.kv_cache_manager import KVCacheManager
from disagg.worker.engine.request import Request, RequestStatus
from disagg.worker.kv_transfer.base import KVTransferParamsError
from disagg.worker.kv_transfer.handoff import Handoff
from disagg.worker.outputs import (
    CachedRequestData,
    EngineCoreOutput,
    KVConnectorOutput,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)

logger = logging.getLogger(__name__)



@dataclass
class SchedulerConfig:
    max_num_batched_tokens: int = 2048  # token budget of one step
    max_num_seqs: int = 64  # running requests at most
    max_model_len: int = 2048  # prompt + output tokens at most
    enable_chunked_prefill: bool = True  # split long prompts across steps
    kv_load_failure_policy: str = "recompute"  # recompute | fail


class AdmitOutcome(enum.Enum):
    SCHEDULED = enum.auto()  # running from this step
    NOT_READY = enum.auto()  # remote KV or a handshake pending: let the next waiting request go first
    NO_ROOM = enum.auto()  # out of blocks or token budget: stop admitting, keeping FCFS order
    FAILED = enum.auto()  # finished with an error while admitting


@dataclass(frozen=True)
class Admission:
    """What _admit did with one waiting request."""

    outcome: AdmitOutcome
    num_new_tokens: int = 0  # SCHEDULED: tokens to compute this step
    data: NewRequestData | None = None  # SCHEDULED: what the runner needs to know of it


_NOT_READY, _NO_ROOM, _FAILED = (Admission(o) for o in (AdmitOutcome.NOT_READY, AdmitOutcome.NO_ROOM,
                                                        AdmitOutcome.FAILED))


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager, connector: Any = None):
        self.config = config
        self.kv = kv_cache_manager
        self.connector = connector  # scheduler-role KV connector or None
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.finished_req_ids: set[str] = set()  # reported to runner/connector in the next SchedulerOutput
        self._preempted_req_ids: set[str] = set()
        self.finished_recving_kv_req_ids: set[str] = set()
        self.failed_recving_kv_req_ids: set[str] = set()
        self._skip_external_kv: set[str] = set()  # remote load failed once; compute locally
        self._num_external_tokens: dict[str, int] = {}
        self._delayed_free: dict[str, Request] = {}  # finished, blocks kept for a remote reader
        self._aborted_recving: dict[str, Request] = {}  # aborted while a remote load writes its blocks
        self._pending_outputs: list[EngineCoreOutput] = []  # finishes that happened outside a step
        self.num_preemptions_total = 0  # counter for metrics
        # prefix-cache lookups, in tokens, counted when a lookup's blocks were taken (as vLLM's counters)
        self.prefix_cache_queries_total = 0
        self.prefix_cache_hits_total = 0

    # ------------------------------------------------------------------ requests
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests or request.request_id in self._delayed_free:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_requests(self, req_ids: list[str] | str, status: RequestStatus, error: str | None = None) -> None:
        """Finish requests from outside a step (abort, stop string, error)."""
        for req_id in [req_ids] if isinstance(req_ids, str) else req_ids:
            req = self.requests.get(req_id)
            if req is None or req.is_finished():
                continue
            if req.status == RequestStatus.WAITING_FOR_REMOTE_KVS and req_id in self.finished_recving_kv_req_ids:
                # its transfer is over (landed or failed) and the step that would admit it has not run: nothing
                # writes into its blocks any more. Waiting for a finish that was already reported would hold
                # them for good, and the landed id would keep the engine stepping without a pause.
                self.finished_recving_kv_req_ids.discard(req_id)
                self.failed_recving_kv_req_ids.discard(req_id)
                self._finish(req, status, error)
                continue
            if req.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                # blocks are being written by a transfer: free them once it is over
                self._dequeue(req)
                req.status, req.error = status, error
                del self.requests[req_id]
                self._aborted_recving[req_id] = req
                self.finished_req_ids.add(req_id)
                continue
            self._finish(req, status, error)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def has_pending_kv_work(self) -> bool:
        """Blocks still held for remote readers or by in-flight loads of aborted requests."""
        return bool(self._delayed_free or self._aborted_recving)

    def has_landed_remote_kv(self) -> bool:
        """Remote KV arrived for some waiting request: the next step admits it (no reason to wait)."""
        return bool(self.finished_recving_kv_req_ids)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting_for_remote_kv(self) -> int:
        return sum(1 for r in self.waiting if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS)

    @property
    def num_delayed_free(self) -> int:
        return len(self._delayed_free)

    # ------------------------------------------------------------------ schedule
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        new_reqs: list[NewRequestData] = []
        cached_reqs: list[CachedRequestData] = []
        preempted_now = False

        # STEP 1: running requests, oldest first; preempt the newest when blocks run out
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            num_new = min(num_new, self.config.max_model_len - req.num_computed_tokens)
            if num_new <= 0:
                i += 1
                continue
            new_blocks = self.kv.allocate_slots(req, num_new)
            while new_blocks is None:
                victim = self.running.pop()
                self._preempt(victim)
                preempted_now = True
                if victim is req:
                    break
                new_blocks = self.kv.allocate_slots(req, num_new)
            if new_blocks is None:
                break
            num_scheduled[req.request_id] = num_new
            budget -= num_new
            cached_reqs.append(CachedRequestData(req.request_id, new_blocks, req.num_computed_tokens))
            i += 1

        # STEP 2: admit waiting requests (not in a step that had to preempt)
        skipped: list[Request] = []
        while self.waiting and budget > 0 and not preempted_now and len(self.running) < self.config.max_num_seqs:
            req = self.waiting.popleft()
            admission = self._admit(req, budget)
            if admission.outcome is AdmitOutcome.FAILED:
                continue
            if admission.outcome is not AdmitOutcome.SCHEDULED:
                skipped.append(req)
                if admission.outcome is AdmitOutcome.NO_ROOM:
                    break
                continue
            num_scheduled[req.request_id] = admission.num_new_tokens
            budget -= admission.num_new_tokens
            new_reqs.append(admission.data)
        self.waiting.extendleft(reversed([r for r in skipped if not r.is_finished()]))

        output = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached_reqs,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            finished_req_ids=self.finished_req_ids,
            preempted_req_ids=self._preempted_req_ids,
        )
        if self.connector is not None:
            output.kv_connector_metadata = self.connector.build_connector_meta(output)
        self.finished_req_ids = set()
        self._preempted_req_ids = set()
        for req_id, n in num_scheduled.items():
            self.requests[req_id].num_computed_tokens += n
        return output

    def _admit(self, req: Request, budget: int) -> Admission:
        """Allocate for one waiting request and, when it can run this step, start it."""
        computed_blocks: list[int] = []
        num_external, load_async = 0, False
        if req.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            if not self._update_waiting_for_remote_kv(req):
                return _FAILED if req.is_finished() else _NOT_READY
        if self._waits_for_sibling(req):
            return _NOT_READY
        fresh = req.request_id not in self.kv.req_to_blocks  # else: remote KV landed in its blocks
        # prompt logprobs need the logits of every prompt position: compute them all here
        needs_prompt = req.sampling_params.prompt_logprobs is not None
        if not fresh:
            num_computed = req.num_computed_tokens
        else:
            computed_blocks, num_local = ([], 0) if needs_prompt else self.kv.get_computed_blocks(req)
            if self.connector is not None and req.request_id not in self._skip_external_kv and not needs_prompt:
                try:
                    n, load_async = self.connector.get_num_new_matched_tokens(req, num_local)
                except KVTransferParamsError as e:
                    self._finish_with_error(req, str(e))
                    return _FAILED
                if n is None:  # the connector cannot tell yet
                    return _NOT_READY
                # a synchronous load must leave one token to compute (its logits are needed)
                num_external = n if load_async else max(0, min(n, req.num_tokens - 1 - num_local))
            num_computed = num_local + num_external
        num_new = 0 if load_async else req.num_tokens - num_computed
        if num_new > budget:
            if not self.config.enable_chunked_prefill:
                return _NO_ROOM
            num_new = budget
        new_blocks = self.kv.allocate_slots(req, num_new + num_external, computed_blocks)
        if new_blocks is None:
            return _NO_ROOM
        if fresh:
            self.prefix_cache_queries_total += req.num_tokens
            self.prefix_cache_hits_total += len(computed_blocks) * self.kv.block_size
        if fresh and self.connector is not None and req.request_id not in self._skip_external_kv:
            self.connector.update_state_after_alloc(req, list(self.kv.get_block_ids(req.request_id)), num_external)
        if load_async:
            req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
            req.num_computed_tokens = num_computed - num_external
            self._num_external_tokens[req.request_id] = num_external
            return _NOT_READY
        req.num_computed_tokens = num_computed
        if req.num_cached_tokens is None:  # first run: later ones (after a preemption) hit its own blocks
            req.num_cached_tokens = num_computed
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        data = NewRequestData(
            req_id=req.request_id,
            prompt_token_ids=req.all_token_ids,
            block_ids=list(self.kv.get_block_ids(req.request_id)),
            num_computed_tokens=num_computed,
            sampling_params=req.sampling_params,
            num_prompt_tokens=req.num_prompt_tokens,
            forced_output_ids=req.forced_output_ids,
        )
        return Admission(AdmitOutcome.SCHEDULED, num_new, data)

    def _waits_for_sibling(self, req: Request) -> bool:
        """A later choice of an n > 1 request waits until the first one has its prompt KV (then sampled)."""
        if req.wait_for is None:
            return False
        sibling = self.requests.get(req.wait_for)
        if sibling is None or sibling.num_output_tokens > 0:
            req.wait_for = None
            return False
        return True

    def _update_waiting_for_remote_kv(self, req: Request) -> bool:
        """True when the request's remote KV has landed (or failed and will be recomputed)."""
        req_id = req.request_id
        if req_id not in self.finished_recving_kv_req_ids:
            return False
        self.finished_recving_kv_req_ids.discard(req_id)
        num_external = self._num_external_tokens.pop(req_id, 0)
        if req_id in self.failed_recving_kv_req_ids:
            self.failed_recving_kv_req_ids.discard(req_id)
            self.kv.uncache_blocks(set(self.kv.get_block_ids(req_id)[req.num_computed_tokens // self.kv.block_size :]))
            if self.config.kv_load_failure_policy == "fail":
                self._finish_with_error(req, f"loading remote KV for request {req_id} failed")
                return False
            logger.warning("remote KV load for %s failed; recomputing the prompt locally", req_id)
            self.kv.free(req)
            req.num_computed_tokens = 0
            req.status = RequestStatus.WAITING
            self._skip_external_kv.add(req_id)
            return True
        # the whole prompt may have arrived; recompute its last token for the logits
        req.num_computed_tokens = min(req.num_computed_tokens + num_external, req.num_tokens - 1)
        self.kv.cache_blocks(req, req.num_computed_tokens)
        req.status = RequestStatus.WAITING
        return True

    def _preempt(self, req: Request) -> None:
        logger.debug("preempting %s (recompute)", req.request_id)
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions_total += 1
        self._preempted_req_ids.add(req.request_id)
        self._skip_external_kv.add(req.request_id)  # its remote KV (if any) was consumed already
        self.waiting.appendleft(req)

    # ------------------------------------------------------------------ update
    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        outputs, self._pending_outputs = self._pending_outputs, []
        kv_output = runner_output.kv_connector_output
        reset: set[str] = set()
        if kv_output is not None and kv_output.invalid_block_ids:
            reset = self._handle_invalid_blocks(kv_output.invalid_block_ids, scheduler_output)
        for req_id in scheduler_output.num_scheduled_tokens:
            req = self.requests.get(req_id)
            if req is None or req.is_finished() or req_id in reset:
                continue
            self.kv.cache_blocks(req, req.num_computed_tokens)
            new_token_ids: list[int] = []
            for token_id in runner_output.sampled_token_ids.get(req_id, []):
                req.output_token_ids.append(token_id)
                new_token_ids.append(token_id)
                if self._check_stop(req, token_id):
                    break
            if req.is_finished():
                self.running.remove(req)
                self._free_request(req)
                outputs.append(self._finish_output(req, new_token_ids))
            elif new_token_ids or req_id in runner_output.prompt_logprobs:
                outputs.append(EngineCoreOutput(req_id, new_token_ids, num_cached_tokens=req.num_cached_tokens or 0))
            if outputs and outputs[-1].req_id == req_id:
                outputs[-1].logprobs = runner_output.logprobs.get(req_id)
                outputs[-1].prompt_logprobs = runner_output.prompt_logprobs.get(req_id)
        if kv_output is not None:
            self._update_from_kv_output(kv_output)
        return outputs

    def _update_from_kv_output(self, kv_output: KVConnectorOutput) -> None:
        for req_id in kv_output.finished_recving or ():
            aborted = self._aborted_recving.pop(req_id, None)
            if aborted is not None:
                self.kv.free(aborted)
                self._free_request(aborted)
            else:
                self.finished_recving_kv_req_ids.add(req_id)
        for req_id in kv_output.finished_sending or ():
            req = self._delayed_free.pop(req_id, None)
            if req is None:
                logger.warning("finished_sending for unknown request %s ignored", req_id)
                continue
            self.kv.free(req)
        if self.connector is not None:
            self.connector.update_connector_output(kv_output)

    def _handle_invalid_blocks(self, invalid: set[int], scheduler_output: SchedulerOutput) -> set[str]:
        """Map failed block loads to requests. Async loads are resolved when their recv finishes;
        requests that ran this step on invalid KV are reset (recompute) or failed."""
        self.kv.uncache_blocks(invalid)
        reset: set[str] = set()
        for req in list(self.requests.values()):
            blocks = self.kv.get_block_ids(req.request_id)
            if not invalid.intersection(blocks):
                continue
            if req.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                self.failed_recving_kv_req_ids.add(req.request_id)
                continue
            if req.request_id not in scheduler_output.num_scheduled_tokens:
                continue
            reset.add(req.request_id)
            self.running.remove(req)
            if self.config.kv_load_failure_policy == "fail":
                self._finish_with_error(req, f"loading external KV for request {req.request_id} failed")
            else:
                logger.warning("external KV for %s invalid; recomputing", req.request_id)
                self._preempt(req)
        return reset

    def _check_stop(self, req: Request, token_id: int) -> bool:
        sp = req.sampling_params
        if not sp.ignore_eos and token_id in req.eos_token_ids:
            req.status = RequestStatus.FINISHED_STOPPED
        elif token_id in sp.stop_token_ids:
            req.status, req.stop_reason = RequestStatus.FINISHED_STOPPED, token_id
        elif req.num_output_tokens >= sp.max_tokens or req.num_tokens >= self.config.max_model_len:
            req.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return req.is_finished()

    def _dequeue(self, req: Request) -> None:
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)

    def _finish_with_error(self, req: Request, error: str) -> None:
        self._finish(req, RequestStatus.FINISHED_ERROR, error)

    def _finish(self, req: Request, status: RequestStatus, error: str | None) -> None:
        """Out of the queues, status set, blocks freed (or handed to a remote reader), output queued."""
        self._dequeue(req)
        req.status, req.error = status, error
        self._free_request(req)
        self._pending_outputs.append(self._finish_output(req, []))

    def _free_request(self, req: Request) -> None:
        """Hand the finished request to the connector; free its blocks unless a remote reader needs them."""
        delay_free, params = False, None
        if self.connector is not None and req.status != RequestStatus.FINISHED_ERROR:
            prefill_hop = req.kv_transfer_params is not None and req.kv_transfer_params.is_prefill_hop
            delay_free, params = self.connector.request_finished(req, list(self.kv.get_block_ids(req.request_id)))
            if isinstance(params, dict):  # a vLLM-style connector's answer
                params = Handoff.parse(params)
            if prefill_hop and req.output_token_ids:  # what it chose: a router may stream it before the decode hop
                params = (params or Handoff()).with_output(req.output_token_ids)
        req.kv_transfer_params = params
        self.requests.pop(req.request_id, None)
        self._skip_external_kv.discard(req.request_id)
        self._num_external_tokens.pop(req.request_id, None)
        self.finished_req_ids.add(req.request_id)
        if delay_free and self.kv.get_block_ids(req.request_id):
            self._delayed_free[req.request_id] = req
        else:
            self.kv.free(req)

    def _finish_output(self, req: Request, new_token_ids: list[int]) -> EngineCoreOutput:
        return EngineCoreOutput(
            req.request_id,
            new_token_ids,
            finish_reason=req.status.finish_reason,
            stop_reason=req.stop_reason,
            kv_transfer_params=req.kv_transfer_params,
            error=req.error,
            num_cached_tokens=req.num_cached_tokens or 0,
        )

    def take_pending_outputs(self) -> list[EngineCoreOutput]:
        """Finishes that happened outside a step (aborts, load failures) and were not yet reported."""
        outputs, self._pending_outputs = self._pending_outputs, []
        return outputs
