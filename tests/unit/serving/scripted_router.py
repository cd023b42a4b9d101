"""A router app over scripted workers (an httpx.MockTransport handler), for the router's unit tests: every
endpoint ready, round-robin, the app reached in-process."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx

from disagg.worker.router.app import build_app
from disagg.worker.router.endpoints import EndpointPool
from disagg.worker.router.metrics import RouterMetrics
from disagg.worker.router.state import RouterState


def scripted_router(prefill: list[str], decode: list[str], workers: Callable[[httpx.Request], httpx.Response],
                    pool_kw: dict[str, Any] | None = None,
                    **state_kw: Any) -> tuple[httpx.AsyncClient, RouterState]:
    """(a client of the router's app, its state); `pool_kw` goes to each EndpointPool, `state_kw` to RouterState."""
    pools = []
    for role, urls in (("prefill", prefill), ("decode", decode)):
        pool = EndpointPool(role, "round-robin", **(pool_kw or {}))
        pool.set_urls(list(urls))
        for ep in pool.endpoints.values():
            ep.ready = True
        pools.append(pool)
    state = RouterState(pools[0], pools[1], RouterMetrics("m"), **state_kw)
    state.client = httpx.AsyncClient(transport=httpx.MockTransport(workers))
    client = httpx.AsyncClient(transport=httpx.ASGITransport(build_app(state)), base_url="http://router")
    return client, state
