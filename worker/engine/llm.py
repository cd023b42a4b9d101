"""Offline API in vLLM's spirit: `LLM(model=DIR).generate(prompts, SamplingParams(...))`."""
from __future__ import annotations

import time
from typing import Any

from disagg.worker.config import EngineConfig
from disagg.worker.kv_transfer.base import KVTransferConfig
from disagg.worker.engine.llm_engine import LLMEngine
from disagg.worker.engine.request_output import RequestOutput
from disagg.worker.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str, *, kv_transfer_config: KVTransferConfig | dict | None = None, **engine_args: Any):
        if isinstance(kv_transfer_config, dict):
            kv_transfer_config = KVTransferConfig(**kv_transfer_config)
        self.engine = LLMEngine(
            EngineConfig(model=str(model), kv_transfer_config=kv_transfer_config or KVTransferConfig(), **engine_args)
        )

    def generate(
        self,
        prompts: str | list[str] | list[int] | list[list[int]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        kv_transfer_params: list[dict[str, Any] | None] | None = None,
    ) -> list[RequestOutput]:
        """Run prompts (strings or lists of token ids) to completion; results in prompt order.
        Every prompt is validated before any runs, so one bad prompt queues nothing.

        Afterwards engine.stats.kv_connector_stats holds this call's per-step connector stats only:
        the previous call's are dropped here (no server drains them offline, so they would pile up)."""
        self.engine.stats.kv_connector_stats.clear()
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        n = len(prompts)
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params or SamplingParams()] * n
        if len(params) != n:
            raise ValueError(f"got {len(params)} sampling params for {n} prompts")
        kv_params = kv_transfer_params or [None] * n
        engine = self.engine
        ids: list[str] = []
        try:
            for i, (prompt, sp, kvp) in enumerate(zip(prompts, params, kv_params)):
                try:
                    ids.append(engine.add_request(prompt, sp, kv_transfer_params=kvp))
                except ValueError as e:
                    raise ValueError(f"prompt {i}: {e}") from None
        except ValueError:
            for req_id in ids:
                engine.abort_request(req_id)
            self._drain()
            raise
        results: dict[str, RequestOutput] = {}
        wanted = set(ids)
        while len(results) < n:
            outputs = engine.step_or_wait()
            for out in outputs:
                if out.finished and out.request_id in wanted:
                    results[out.request_id] = out
            if not outputs and not engine.has_unfinished_requests() and len(results) < n:
                raise RuntimeError("engine has no unfinished requests but some results are missing")
        self._drain()
        return [results[r] for r in ids]

    def _drain(self, timeout: float = 60.0) -> None:
        """Step until blocks held for remote readers are released (or the lease frees them)."""
        deadline = time.monotonic() + timeout
        while self.engine.has_pending_kv_work() and time.monotonic() < deadline:
            self.engine.step_or_wait()

    def shutdown(self) -> None:
        self.engine.shutdown()
