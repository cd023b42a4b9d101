"""What the engine reports for metrics: running totals (EngineStats, kept by the engine) and one reading of its
gauges and totals (EngineSnapshot, what the server's metrics take after a step)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from disagg.worker.engine.scheduler import Scheduler
    from disagg.worker.kv_transfer.base import KVConnectorBase


@dataclass
class EngineStats:
    """Counters since start (for Prometheus)."""

    prompt_tokens: int = 0  # prompt tokens of requests that produced their first token
    generation_tokens: int = 0
    # per step; readers drain it (the server's loop into metrics, LLM.generate at each call)
    kv_connector_stats: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class EngineSnapshot:
    """Engine gauges and totals read in the engine thread after a step (plain values, no engine reference)."""

    num_running: int
    num_waiting: int  # includes requests waiting for remote KV, as in vLLM
    num_waiting_prompt_tokens: int  # prompt tokens of the waiting requests (queued prefill work)
    kv_cache_usage: float  # 0..1
    num_preemptions_total: int
    prompt_tokens_total: int
    generation_tokens_total: int
    pending_sends: int  # requests whose KV waits at this (prefill) worker to be pulled
    pending_loads: int  # requests waiting at this (decode) worker for remote KV
    prefix_cache_queries_total: int = 0  # prompt tokens looked up in the local prefix cache
    prefix_cache_hits_total: int = 0  # of those, tokens found there


@dataclass(frozen=True)
class QueueLoad:
    """What admission weighs (server/admission.py): the engine's queue as it is now, read in the engine thread."""

    waiting: int  # requests queued (those waiting for remote KV too)
    waiting_prompt_tokens: int  # prompt tokens the queued requests will compute here (remote KV not counted)
    free_slots: int  # running slots left (max_num_seqs - running): that many waiting requests start next step


def queue_load(scheduler: Scheduler) -> QueueLoad:
    local = sum(r.num_prompt_tokens - r.num_computed_tokens for r in scheduler.waiting
                if r.kv_transfer_params is None or r.kv_transfer_params.remote is None)
    return QueueLoad(scheduler.num_waiting, max(local, 0),
                     max(scheduler.config.max_num_seqs - scheduler.num_running, 0))


def engine_snapshot(scheduler: Scheduler, kv_cache_usage: float, connector: KVConnectorBase | None,
                    stats: EngineStats) -> EngineSnapshot:
    """connector: the scheduler-role one (it knows the pending sends and loads), or None."""
    pending = connector.get_pending_counts() if connector is not None else {}
    return EngineSnapshot(
        num_running=scheduler.num_running, num_waiting=scheduler.num_waiting,
        num_waiting_prompt_tokens=sum(r.num_prompt_tokens for r in scheduler.waiting),
        kv_cache_usage=kv_cache_usage, num_preemptions_total=scheduler.num_preemptions_total,
        prompt_tokens_total=stats.prompt_tokens, generation_tokens_total=stats.generation_tokens,
        pending_sends=pending.get("pending_sends", 0), pending_loads=pending.get("pending_loads", 0),
        prefix_cache_queries_total=scheduler.prefix_cache_queries_total,
        prefix_cache_hits_total=scheduler.prefix_cache_hits_total,
    )
