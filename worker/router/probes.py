"""The router's view of its workers: each endpoint's readiness (GET /ready, or /health where a worker has no
/ready, as vLLM's), whether it stopped answering (Endpoint.unresponsive), its load from /metrics, and the model
name for metric labels. One probe round per --probe-interval, on the probes' own connection pool
(RouterState.probes): a full hop pool never delays a probe, so it never makes a busy worker look hung."""
from __future__ import annotations

import asyncio
import logging
import time

import httpx

from disagg.worker.router import outliers
from disagg.worker.router.endpoints import Endpoint, EndpointPool, load_from_metrics
from disagg.worker.router.state import RouterState
from disagg.worker.router.timeouts import Deadline

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


READY_POLL_S = 0.1  # how often a request waiting for a ready endpoint probes the candidates


async def await_ready(state: RouterState, pool: EndpointPool, deadline: Deadline) -> bool:
    """No endpoint of `pool` is ready. Wait, at most the connect bound (and what is left of the request's), for
    one to become ready, probing now rather than at the next probe round those that may be about to: endpoints
    not yet probed, or answering their probes with "not ready" (a pod starting, which its Deployment counts
    ready a moment before this router's next probe round, as the old pod goes). Endpoints whose probes time out
    (hung), that refuse connections (gone) or that are ejected are not waited for; nor is an empty pool.
    True when one became ready."""
    def hopeful() -> list[Endpoint]:
        now = time.monotonic()
        return [e for e in pool.endpoints.values() if not e.ready and e.probe_timeouts == 0 and e.refused_at is None
                and not outliers.is_ejected(e.health, now)]

    until = time.monotonic() + min(deadline.timeouts.connect_s, max(deadline.remaining(), 0.0))
    waited = False
    while (candidates := hopeful()) and time.monotonic() < until:
        if not waited:
            logger.info("no %s endpoint ready; waiting up to %.1f s for %s", pool.role, until - time.monotonic(),
                        ", ".join(e.url for e in candidates))
            waited = True
        await asyncio.gather(*(_shared_probe(state, ep) for ep in candidates))
        if ready := pool.available():
            logger.info("%s endpoint %s is ready; the waiting request goes on", pool.role, ready[0].url)
            return True
        await asyncio.sleep(min(READY_POLL_S, max(until - time.monotonic(), 0.0)))
    return bool(pool.available())


async def probe_not_ready(state: RouterState, pool: EndpointPool) -> None:
    """Probe now the endpoints of `pool` that are not ready and whose probes do not time out (starting workers:
    they refuse connections until they listen, then answer "not ready" until loaded) - for held requests."""
    await asyncio.gather(*(_shared_probe(state, ep) for ep in list(pool.endpoints.values())
                           if not ep.ready and ep.probe_timeouts == 0))


async def probe_endpoint(state: RouterState, ep: Endpoint) -> bool:
    """Probe `ep` now (sharing a probe already in flight); whether it is ready."""
    await _shared_probe(state, ep)
    return ep.ready


async def _shared_probe(state: RouterState, ep: Endpoint) -> None:
    """Many requests may wait at once: they share one probe per endpoint."""
    task = ep.waiting_probe
    if task is None or task.done():
        task = ep.waiting_probe = asyncio.ensure_future(_probe(state, ep, scrape=False))
    await asyncio.shield(task)


async def _probe(state: RouterState, ep: Endpoint, scrape: bool = True) -> None:
    timeout = min(2.0, state.probe_interval_s * 2)
    sent_at = time.monotonic()
    try:
        r = await _get(state, f"{ep.url}{ep.ready_path or '/ready'}", timeout)
        if r.status_code == 404 and ep.ready_path is None:  # no /ready (vLLM): its /health answers once it serves
            logger.info("endpoint %s has no /ready; probing /health", ep.url)
            ep.ready_path = "/health"
            r = await _get(state, f"{ep.url}/health", timeout)
        elif ep.ready_path is None:
            ep.ready_path = "/ready"
        ready = r.status_code == 200
        ep.probe_answered()
        ep.refused_at = None
        ep.failed_fast = False  # its probe's verdict from now on
    except httpx.TimeoutException:
        ep.probe_timed_out(sent_at)
        ready = ep.ready and not ep.unresponsive()
    except httpx.HTTPError as e:
        if ep.ready:
            logger.info("endpoint %s: probe failed: %s: %s", ep.url, type(e).__name__, e)
        ready = False
        ep.refused_at = time.monotonic()
        ep.failed_fast = False
    if ready != ep.ready:
        logger.info("endpoint %s is %s", ep.url, "ready" if ready else "not ready")
    ep.ready = ready
    if not scrape:
        return
    if ready and state.prefill.scrapes_metrics:  # one policy for both pools
        await _scrape_load(state, ep, timeout)
    if ready and state.metrics.model_name == "":
        try:
            r = await state.probes.get(f"{ep.url}/v1/models", timeout=2.0)
            state.metrics.learned_model(r.json()["data"][0]["id"])
        except (httpx.HTTPError, ValueError, KeyError, IndexError):
            pass


async def _get(state: RouterState, url: str, timeout: float) -> httpx.Response:
    """GET, asked once more on a fresh connection when the pooled one it went out on was dropped before any
    answer. The router's client expires idle connections before workers close them (routing.KEEPALIVE_EXPIRY_S),
    but a worker may still close one for its own reasons, and one closed just as the probe reuses it is no
    verdict on the worker - taken as one, a busy worker left the pool until a probe passed,
    which on a starved CPU (probes timing out meanwhile) was a minute with no decode endpoint."""
    try:
        return await state.probes.get(url, timeout=timeout)
    except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError):
        return await state.probes.get(url, timeout=timeout)


async def _scrape_load(state: RouterState, ep: Endpoint, timeout: float) -> None:
    """The worker's own running + waiting requests and KV usage (vLLM's names, which ours exports too)."""
    try:
        r = await state.probes.get(f"{ep.url}/metrics", timeout=timeout)
    except httpx.HTTPError:
        return
    load = load_from_metrics(r.text) if r.status_code == 200 else None
    if load is not None:
        ep.reported_load, ep.kv_usage = load
