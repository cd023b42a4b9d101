"""The router's view of its workers: each endpoint's readiness (GET /ready, or /health where a worker has no
/ready, as vLLM's), whether it stopped answering (Endpoint.unresponsive), its load from /metrics, and the model
name for metric labels. One probe round per --probe-interval."""
from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

import httpx

from disagg.worker.router.endpoints import Endpoint, load_from_metrics

if TYPE_CHECKING:
    from disagg.worker.router.proxy import RouterState

logger = logging.getLogger(__name__)


async def probe_forever(state: RouterState) -> None:
    """Keep each endpoint's `ready` current (GET /ready, or /health where there is no /ready) and its load
    (GET /metrics, least-loaded only); learn the model name for metric labels."""
    while True:
        await probe_once(state)
        await asyncio.sleep(state.probe_interval_s)


async def probe_once(state: RouterState) -> None:
    endpoints = list(state.prefill.endpoints.values()) + list(state.decode.endpoints.values())
    await asyncio.gather(*(_probe(state, ep) for ep in endpoints))


async def _probe(state: RouterState, ep: Endpoint) -> None:
    timeout = min(2.0, state.probe_interval_s * 2)
    sent_at = time.monotonic()
    try:
        r = await state.client.get(f"{ep.url}{ep.ready_path or '/ready'}", timeout=timeout)
        if r.status_code == 404 and ep.ready_path is None:  # no /ready (vLLM): its /health answers once it serves
            logger.info("endpoint %s has no /ready; probing /health", ep.url)
            ep.ready_path = "/health"
            r = await state.client.get(f"{ep.url}/health", timeout=timeout)
        elif ep.ready_path is None:
            ep.ready_path = "/ready"
        ready = r.status_code == 200
        ep.probe_answered()
    except httpx.TimeoutException:
        ep.probe_timed_out(sent_at)
        ready = ep.ready and not ep.unresponsive()
    except httpx.HTTPError:
        ready = False
    if ready != ep.ready:
        logger.info("endpoint %s is %s", ep.url, "ready" if ready else "not ready")
    ep.ready = ready
    if ready and state.prefill.policy != "round-robin":
        await _scrape_load(state, ep, timeout)
    if ready and state.metrics.model_name == "":
        try:
            r = await state.client.get(f"{ep.url}/v1/models", timeout=2.0)
            state.metrics.model_name = r.json()["data"][0]["id"]
        except (httpx.HTTPError, ValueError, KeyError, IndexError):
            pass


async def _scrape_load(state: RouterState, ep: Endpoint, timeout: float) -> None:
    """The worker's own running + waiting requests and KV usage (vLLM's names, which ours exports too)."""
    try:
        r = await state.client.get(f"{ep.url}/metrics", timeout=timeout)
    except httpx.HTTPError:
        return
    load = load_from_metrics(r.text) if r.status_code == 200 else None
    if load is not None:
        ep.reported_load, ep.kv_usage = load
