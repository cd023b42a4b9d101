"""KV-connector API, split like vLLM V1's KVConnectorBase_V1 into a scheduler role and a worker role.

Method names and meanings follow vLLM so a connector written for one is easy to port. Two
instances exist per engine: one with role SCHEDULER (pure bookkeeping, runs in the scheduler)
and one with role WORKER (touches KV memory, runs in the model runner).

KV-cache layout handed to `register_kv_caches`: one tensor for all layers under the key
"kv_cache", block-major: (num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim).
A block's K and V for every layer are therefore one contiguous byte range, so a run of
consecutive block ids is a single transfer descriptor.
"""
from __future__ import annotations

import enum
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from disagg.worker.metric_names import KV_BYTES_LOADED, KV_BYTES_SAVED

if TYPE_CHECKING:  # the scheduler side never imports torch
    import torch

    from disagg.worker.outputs import ConnectorRequest, SchedulerOutput
    from disagg.worker.kv_transfer.handoff import Handoff
    from disagg.worker.kv_transfer.handoff_auth import HandoffSigner


class KVConnectorRole(enum.Enum):
    SCHEDULER = "scheduler"
    WORKER = "worker"


KV_LOAD_FAILURE_POLICIES = ("recompute", "fail")


class KVTransferParamsError(ValueError):
    """A request's kv_transfer_params cannot be served (malformed, out of range, incompatible peer).

    Raised by the scheduler side (get_num_new_matched_tokens / validate_kv_transfer_params): the
    request fails with this message before any block is allocated; other requests are unaffected."""


@dataclass
class KVTransferConfig:
    kv_connector: str | None = None  # registered name, or None for no connector
    kv_connector_module_path: str | None = None  # "package.module:ClassName" for out-of-tree connectors
    kv_role: str = "kv_both"  # kv_producer (prefill) | kv_consumer (decode) | kv_both
    engine_id: str = ""  # unique per engine; filled in by the engine when empty
    kv_load_failure_policy: str = "recompute"  # recompute | fail
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)  # connector-specific
    # authenticates the connector's own channels between the pods of one resource (NIXL: the side channel and
    # notifications); a handoff_auth.HandoffSigner, None when no hand-off key is configured
    auth: "HandoffSigner | None" = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.kv_load_failure_policy not in KV_LOAD_FAILURE_POLICIES:
            raise ValueError(
                f"kv_load_failure_policy={self.kv_load_failure_policy!r}: expected one of "
                f"{', '.join(KV_LOAD_FAILURE_POLICIES)}"
            )
        if self.kv_role not in ("kv_producer", "kv_consumer", "kv_both"):
            raise ValueError(f"kv_role={self.kv_role!r}: expected kv_producer, kv_consumer or kv_both")


@dataclass(frozen=True)
class KVCacheSpec:
    """What a connector needs to know about the engine's KV cache."""

    model_name: str  # served model (checkpoint path or name)
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int  # tokens per block
    num_blocks: int
    dtype: str  # "float32" | "bfloat16" | "float16"

    @property
    def bytes_per_block(self) -> int:
        itemsize = {"float32": 4, "bfloat16": 2, "float16": 2}[self.dtype]
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim * itemsize


@dataclass(frozen=True)
class ConnectorMetric:
    """A Prometheus metric a connector's stats feed (as in vLLM, each connector describes its own). The worker
    registers it with the model_name and role labels, and after each step feeds it the value under `stats_key` in
    the connector's get_kv_connector_stats(): a histogram observes every value of a list (one per transfer), a
    counter adds a number or every value of a list, a gauge is set to a number. A missing key, None or an empty
    list changes nothing. Stats keys mean the same for every connector (a built-in key feeds that metric)."""

    name: str  # without the _total a counter gets; vLLM's name where vLLM has the metric (metric_names.py)
    kind: Literal["counter", "gauge", "histogram"]
    documentation: str  # the HELP text
    stats_key: str  # the key in get_kv_connector_stats()'s dict that feeds it
    buckets: tuple[float, ...] = ()  # a histogram's bucket upper bounds


def kv_bytes_loaded(stats_key: str) -> ConnectorMetric:
    """disagg:kv_bytes_loaded, fed by `stats_key`: every connector that receives KV from another worker."""
    return ConnectorMetric(KV_BYTES_LOADED, "counter", "KV-cache bytes received from another worker (any connector).",
                           stats_key)


def kv_bytes_saved(stats_key: str) -> ConnectorMetric:
    """disagg:kv_bytes_saved, fed by `stats_key`: every connector that writes KV for another worker."""
    return ConnectorMetric(KV_BYTES_SAVED, "counter", "KV-cache bytes written for another worker (connectors that "
                           "push, e.g. shared storage).", stats_key)


class KVConnectorBase(ABC):
    # the metrics its get_kv_connector_stats() feeds; the worker exports them (server/metrics.py)
    metrics: ClassVar[tuple[ConnectorMetric, ...]] = ()

    def __init__(self, config: KVTransferConfig, role: KVConnectorRole, kv_cache_spec: KVCacheSpec):
        self.config = config
        self.role = role
        self.kv_cache_spec = kv_cache_spec
        self._connector_metadata: Any = None

    # ---------------- worker role ----------------
    def register_kv_caches(self, kv_caches: dict[str, "torch.Tensor"]) -> None:
        """Called once after the KV cache is allocated (see the module docstring for the layout)."""

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        self._connector_metadata = connector_metadata

    def clear_connector_metadata(self) -> None:
        self._connector_metadata = None

    def _get_connector_metadata(self) -> Any:
        assert self._connector_metadata is not None, "connector metadata is only bound inside a step"
        return self._connector_metadata

    def start_load_kv(self, **kwargs: Any) -> None:
        """Start loading remote KV for this step (may be asynchronous)."""

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Block until the KV of `layer_name` is loaded (layer-wise pipelining)."""

    def save_kv_layer(self, layer_name: str, kv_layer: "torch.Tensor", attn_metadata: Any, **kwargs: Any) -> None:
        """Start saving one layer's KV after the attention layer wrote it."""

    def wait_for_save(self) -> None:
        """Block until every save started this step is done, so the KV buffer may be reused."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """(finished_sending, finished_recving) request ids since the last call."""
        return None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Local block ids whose asynchronous load failed since the last call."""
        return set()

    def wait_for_kv_progress(self, timeout: float) -> None:
        """Idle wait of the engine while asynchronous KV work is pending: up to `timeout` seconds, less
        when the connector can tell that a load finished (the next step admits that request)."""
        time.sleep(timeout)

    def get_kv_connector_stats(self) -> dict[str, Any] | None:
        """Counters for this step (e.g. bytes transferred); None when there is nothing to report."""
        return None

    def shutdown(self) -> None:
        """Release connector resources (threads, registered memory, sockets)."""

    # ---------------- scheduler role ----------------
    def validate_kv_transfer_params(self, prompt_token_ids: list[int], params: "Handoff") -> None:
        """Reject a hand-off this connector cannot act on when the request arrives (raise KVTransferParamsError).
        It is already parsed (handoff.Handoff: well-formed, the connector's declared extra keys type-checked)."""

    @abstractmethod
    def get_num_new_matched_tokens(self, request: "ConnectorRequest",
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        """(tokens available externally beyond num_computed_tokens, whether they load asynchronously).

        None as the count means "not known yet, ask again next step". Raising KVTransferParamsError
        fails the request with that message."""

    @abstractmethod
    def update_state_after_alloc(self, request: "ConnectorRequest",
                                 block_ids: list[int], num_external_tokens: int) -> None:
        """Blocks were allocated for the request; remember which ones receive external KV."""

    @abstractmethod
    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> Any:
        """Metadata for the worker side for this step; resets per-step scheduler-side state."""

    def update_connector_output(self, connector_output: Any) -> None:
        """The scheduler saw the step's KVConnectorOutput (e.g. to track finished sends)."""

    def request_finished(self, request: "ConnectorRequest", block_ids: list[int]
                         ) -> tuple[bool, "Handoff | dict[str, Any] | None"]:
        """(delay_free, kv_transfer_params for the decode side: a Handoff, or a vLLM-style dict the scheduler
        parses). delay_free=True keeps the blocks until finished_sending reports the request.
        `request.kv_transfer_params` is the request's Handoff (None without one); like vLLM's params dict it
        answers `.get(key)` by wire key."""
        return False, None

    def get_pending_counts(self) -> dict[str, int]:
        """Gauges for metrics: {"pending_sends": n, "pending_loads": n}."""
        return {"pending_sends": 0, "pending_loads": 0}

    def release(self, request_id: str) -> bool:
        """Nobody will pull this finished request's KV (its decode hop was refused): free its blocks at the next
        step instead of at the lease end. False when no KV of that request waits here (pulled already, expired,
        unknown, or a connector that keeps no blocks for readers)."""
        return False
