"""The prefill hop run from the decode side: a gateway's endpoint picker sends a request straight to a decode pod
and names, in x-prefiller-host-port, the prefill endpoint to compute its prompt. The decode side (our worker
natively; `disagg pd-proxy` in front of vLLM) runs the router's prefill hop (hops.prefill_hop) to that endpoint,
then decodes with the hand-off it got.

The named endpoint is taken only if it is a member of this resource's prefill pool, as the decode side's own
discovery knows it (an allowlist): a header naming any other host is refused - never connected to - and the
request is decoded alone. Other ready prefill endpoints of the pool stand behind the named one when it fails,
as in the router.
"""
from __future__ import annotations

import logging
from typing import Any
from urllib.parse import urlsplit

from disagg.worker.router.hops import PrefillOutcome, prefill_hop
from disagg.worker.router.policy import RoutePlan
from disagg.worker.router.replies import Reply
from disagg.worker.router.state import RouterState
from disagg.worker.router.timeouts import Deadline

logger = logging.getLogger(__name__)

PREFILL_HEADER = "x-prefiller-host-port"  # llm-d's P/D convention; set only by the endpoint picker


def allowed_prefill(state: RouterState, target: str) -> str | None:
    """The prefill pool's URL of `target` ("host:port"), or None when it names no member of the pool."""
    for url in state.prefill.endpoints:
        if urlsplit(url).netloc == target.strip():
            return url
    return None


async def prefill_for(state: RouterState, target: str, path: str, body: dict[str, Any], headers: dict[str, str]
                      ) -> PrefillOutcome | Reply:
    """The hand-off for `body` from the named prefill endpoint (or another of the pool when it fails); an empty
    outcome (decode alone) when the name is not an allowed endpoint or no prefill endpoint gave KV; a Reply to
    pass back when the prefill rejected the request itself (4xx)."""
    url = allowed_prefill(state, target)
    if url is None:
        logger.warning("request %s: x-prefiller-host-port %r is not a prefill endpoint of this resource (%d "
                       "known); not contacting it, decoding alone", headers.get("X-Request-Id"), target[:200],
                       len(state.prefill.endpoints))
        state.metrics.refused_prefill_target()
        state.metrics.fell_back_to_decode_alone()
        return PrefillOutcome()
    plan = RoutePlan(prefill_costs={url: 0.0})  # the named endpoint first, the pool's others behind it
    outcome = await prefill_hop(state, plan, path, body, headers, Deadline(state.timeouts))
    if isinstance(outcome, PrefillOutcome) and outcome.handoff is None:
        state.metrics.fell_back_to_decode_alone()
    return outcome
