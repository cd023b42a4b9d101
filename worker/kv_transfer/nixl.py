"""NIXL KV connector: the decode engine READs each prompt's KV blocks from the prefill engine.

Flow (vLLM's NIXL protocol, one prefill and one decode hop per request):
  prefill: request with kv_transfer_params {"do_remote_decode": true} runs its prompt, finishes;
           request_finished() keeps its blocks (delay_free) and returns kv_transfer_params naming
           this engine, its side channel and the prompt's block ids; the blocks stay until the
           decode side's notification arrives or the lease expires.
  decode:  request with those params -> get_num_new_matched_tokens() asks for the prompt's tokens
           asynchronously (after a side-channel handshake, validated before any allocation);
           the worker side READs the remote blocks into the freshly allocated local ones
           (contiguous runs coalesced), completion surfaces as finished_recving, and the READ's
           notification tells prefill to free (on a full local prefix hit the notification
           alone, sent and tracked the same way). Failures surface as invalid_block_ids.

As in vLLM, NixlConnector is a facade over one of two sides, chosen by role: NixlConnectorScheduler
(nixl_scheduler.py: params, handshakes, which blocks move; its network I/O, the handshake, runs in a
background thread and the scheduler is asked again next step until it is done) and NixlConnectorWorker
(nixl_worker.py: KV registration, side channel, READs). They share only nixl_metadata.py. NIXL's
progress thread is off (it burns a core); our own ProgressThread (nixl_progress.py) owns the agent and
posts and progresses every transfer, so a READ never runs inside an engine step (see nixl_worker.py).
kv_transfer_params arrive parsed (handoff.Handoff: its `remote` names the prefill engine and blocks).

extra config: side_channel_host (bind; default 127.0.0.1), side_channel_advertise_host (what
peers dial; default the bind host), side_channel_port (0 = pick a free port), lease_seconds
(default 30), handshake_timeout_seconds (default 5; per socket operation, a whole fetch gets twice that),
lease_margin_seconds (default 1), read_timeout_seconds (default 10). The README's "KV transfer bounds"
table says what each bounds and what happens when it runs out.

Hung peers: a READ (or notification) not finished read_timeout_seconds after its post, or still
running when the prefill's lease ends, is abandoned (NixlTransport.abandon: handles released, the
peer's agent unloaded so nothing lands later and the next handshake loads a fresh one); its blocks
are reported invalid and the load-failure policy applies.

Leases: prefill frees unread blocks when the lease runs out and may reuse them at once, so a late
READ would copy another request's KV without any error. kv_transfer_params therefore carry the
lease's wall-clock end (remote_lease_expires_at); the decode side does not start a READ within
lease_margin_seconds of it and treats the KV as lost (recompute or fail). Node clocks must agree
to within that margin (NTP).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from disagg.worker.kv_transfer.base import KVCacheSpec, KVConnectorBase, KVConnectorRole, KVTransferConfig
from disagg.worker.kv_transfer.handoff import Handoff
from disagg.worker.kv_transfer.nixl_metadata import NixlConnectorMetadata, NixlSettings
from disagg.worker.kv_transfer.nixl_metrics import NIXL_METRICS
from disagg.worker.kv_transfer.nixl_scheduler import NixlConnectorScheduler
from disagg.worker.kv_transfer.nixl_worker import NixlConnectorWorker

if TYPE_CHECKING:
    import torch

    from disagg.worker.outputs import ConnectorRequest, SchedulerOutput
    from disagg.worker.kv_transfer.nixl_transport import NixlTransport

__all__ = ["NixlConnector"]


def _require_nixl() -> None:
    try:
        import nixl._api  # noqa: F401
    except ImportError as e:
        raise ImportError(
            "NixlConnector needs the 'nixl' package: pip install nixl==1.5.1 (install torch first, "
            f"since nixl declares it) ({e})"
        ) from e


class NixlConnector(KVConnectorBase):
    """KVConnectorBase over NixlConnectorScheduler (role SCHEDULER) or NixlConnectorWorker (role WORKER)."""

    metrics = NIXL_METRICS

    def __init__(self, config: KVTransferConfig, role: KVConnectorRole, kv_cache_spec: KVCacheSpec):
        _require_nixl()
        super().__init__(config, role, kv_cache_spec)
        self.settings = NixlSettings.from_config(config)
        self.port = self.settings.port  # side channel port (picked here when the config left it 0)
        self._scheduler: NixlConnectorScheduler | None = None
        self._worker: NixlConnectorWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = NixlConnectorScheduler(self.settings, kv_cache_spec, config.kv_load_failure_policy)
        else:
            self._worker = NixlConnectorWorker(self.settings, kv_cache_spec)

    def _scheduler_side(self) -> NixlConnectorScheduler:
        if self._scheduler is None:
            raise RuntimeError("a scheduler-role method was called on the worker-role NixlConnector")
        return self._scheduler

    def _worker_side(self) -> NixlConnectorWorker:
        if self._worker is None:
            raise RuntimeError("a worker-role method was called on the scheduler-role NixlConnector")
        return self._worker

    # ---------------- worker role
    @property
    def transport(self) -> "NixlTransport | None":
        return self._worker_side().transport

    def register_kv_caches(self, kv_caches: dict[str, "torch.Tensor"]) -> None:
        self._worker_side().register_kv_caches(kv_caches)

    def start_load_kv(self, **kwargs: Any) -> None:
        meta: NixlConnectorMetadata = self._get_connector_metadata()
        self._worker_side().start_load_kv(meta)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self._worker_side().get_finished()

    def wait_for_kv_progress(self, timeout: float) -> None:
        self._worker_side().wait_for_landed(timeout)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker_side().get_block_ids_with_load_errors()

    def get_kv_connector_stats(self) -> dict[str, Any] | None:
        return self._worker_side().get_kv_connector_stats()

    # ---------------- scheduler role
    def validate_kv_transfer_params(self, prompt_token_ids: list[int], params: Handoff) -> None:
        self._scheduler_side().validate_kv_transfer_params(prompt_token_ids, params)

    def get_num_new_matched_tokens(self, request: "ConnectorRequest",
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler_side().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: "ConnectorRequest",
                                 block_ids: list[int], num_external_tokens: int) -> None:
        self._scheduler_side().update_state_after_alloc(request, block_ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> NixlConnectorMetadata:
        return self._scheduler_side().build_connector_meta()

    def update_connector_output(self, connector_output: Any) -> None:
        self._scheduler_side().update_connector_output(connector_output)

    def request_finished(self, request: "ConnectorRequest", block_ids: list[int]) -> tuple[bool, Handoff | None]:
        return self._scheduler_side().request_finished(request, block_ids)

    def get_pending_counts(self) -> dict[str, int]:
        return self._scheduler_side().get_pending_counts()

    def release(self, request_id: str) -> bool:
        return self._scheduler_side().release(request_id)

    # ---------------- both
    def shutdown(self) -> None:
        (self._scheduler or self._worker).shutdown()
