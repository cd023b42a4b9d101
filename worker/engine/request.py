"""A request as the scheduler sees it: token ids and bookkeeping, no tensors."""
from __future__ import annotations

import enum
import time

from disagg.worker.sampling_params import SamplingParams
from disagg.worker.kv_transfer.handoff import Handoff


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    WAITING_FOR_REMOTE_KVS = enum.auto()  # blocks allocated, remote KV loading asynchronously
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # everything after here is finished
    FINISHED_STOPPED = enum.auto()  # EOS, stop token or stop string
    FINISHED_LENGTH_CAPPED = enum.auto()  # max_tokens or max_model_len
    FINISHED_ABORTED = enum.auto()  # client went away / aborted
    FINISHED_ERROR = enum.auto()  # e.g. remote KV load failed under policy "fail"

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return {
            RequestStatus.FINISHED_STOPPED: "stop",
            RequestStatus.FINISHED_LENGTH_CAPPED: "length",
            RequestStatus.FINISHED_ABORTED: "abort",
            RequestStatus.FINISHED_ERROR: "error",
        }.get(self)


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: set[int] | frozenset[int] = frozenset(),
        kv_transfer_params: Handoff | None = None,
        arrival_time: float | None = None,
    ):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = frozenset(eos_token_ids)
        self.kv_transfer_params = kv_transfer_params  # P/D hand-off in; out: set by request_finished
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0  # tokens whose KV is in this engine's cache
        self.num_cached_tokens: int | None = None  # prompt tokens from the prefix cache / remote KV; set at first run
        self.status = RequestStatus.WAITING
        self.block_hashes: list[bytes] = []  # hash chain of the full blocks of all_token_ids
        self.num_preemptions = 0
        self.error: str | None = None  # set with FINISHED_ERROR
        self.stop_reason: int | str | None = None  # the stop token or string that ended it
        # n > 1: a later choice waits for its first sibling's prompt KV (computed or loaded once), then shares
        # its full blocks through the prefix cache (ref counts) and computes only the partial last block
        self.wait_for: str | None = None
        # P/D: the first output tokens, already chosen by the prefill engine and delivered to the client (the
        # router streamed them); they replace what this engine samples at those positions
        self.forced_output_ids: tuple[int, ...] = ()

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def is_finished(self) -> bool:
        return self.status.finished

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, prompt={self.num_prompt_tokens}, "
            f"out={self.num_output_tokens}, computed={self.num_computed_tokens})"
        )
