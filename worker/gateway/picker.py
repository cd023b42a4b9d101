"""The endpoint picker's decision: the router's routing core (pools, policy, prefix facts, revision pairing,
ejection; router/state.py) asked where one request goes, answered in the endpoint-picker protocol's terms.

    decode   the policy's first choice among ready decode endpoints (inside the gateway's subset hint, if any);
             none ready: wait up to the connect bound for one that is starting, else 503; every one at capacity
             (it answered 429): wait briefly for room, else 429 with Retry-After (router/capacity.py)
    prefill  for P/D: the policy's choice among prefill endpoints of the decode's serving revision, which the
             decode side calls itself (x-prefiller-host-port); none when the policy skips the prefill hop (the
             decode holds the prompt's KV), for prompt logprobs, or when no prefill endpoint is ready; every one
             at capacity: as for decode (the request is shed rather than computed at the decode)

Requests in flight are counted per endpoint from the pick until the gateway closes the request's stream (the
request ended), as the router counts its own; the workers' /metrics (probes) add what other pickers sent. A
worker's 429 reaches the picker where the gateway sends it the response headers (our Envoy's configuration does):
that endpoint is then saturated until its Retry-After, as in the router.
"""
from __future__ import annotations

import json
import logging
import time
from typing import Any
from urllib.parse import urlsplit

from disagg.worker.api_keys import OPEN_PATHS
from disagg.worker.gateway.ext_proc import Pick, PickRequest
from disagg.worker.router.capacity import Shed, next_endpoint, released, room_for, saturated
from disagg.worker.router.endpoints import Endpoint, EndpointPool
from disagg.worker.router.hop_bodies import GENERATION_PATHS, needs_prompt_logits
from disagg.worker.router.policy import RoutePlan
from disagg.worker.router.state import RouterState
from disagg.worker.router.timeouts import Deadline

logger = logging.getLogger(__name__)

RETRY_AFTER_S = 1  # what a refused request is told to wait


def host_port(url: str) -> str:
    """An endpoint's base URL as the gateway addresses it: "ip:port"."""
    parts = urlsplit(url)
    return parts.netloc


class RoutingPicker:
    def __init__(self, state: RouterState):
        self.state = state
        self._routed: dict[int, list[tuple[EndpointPool, Endpoint]]] = {}  # id(pick) -> where it is in flight
        self._refused: set[int] = set()  # id(pick) of those its decode answered 429 (it freed nothing there)

    async def pick(self, request: PickRequest) -> Pick:
        state = self.state
        started = time.monotonic()
        body = _json_object(request.body)
        path = request.path.split("?", 1)[0]
        generation = path in GENERATION_PATHS and body is not None
        held = await state.hold.wait_for(state.decode) if state.hold is not None else None
        if held is not None and not isinstance(held, float):  # the hold queue is full or the hold ran out
            state.metrics.request(f"hold_{held.reason}")
            return Pick(status=held.status, retry_after_s=held.retry_after_s, message=held.message)
        plan = await state.plan(body, path) if generation else RoutePlan()
        deadline = Deadline(state.timeouts)
        decode = await self._decode(plan, request.subset, deadline)
        if isinstance(decode, Shed):
            return Pick(status=429, retry_after_s=decode.retry_after_s, message=decode.message)
        if decode is None:
            state.metrics.request("unavailable")
            where = f" of the gateway's subset {list(request.subset)}" if request.subset is not None else ""
            return Pick(status=503, retry_after_s=RETRY_AFTER_S, message=f"no decode endpoint{where} is ready "
                        f"({len(state.decode.endpoints)} known)")
        prefill = None
        if generation and state.prefill.endpoints and not plan.skip_prefill and not needs_prompt_logits(body):
            prefill = await next_endpoint(state, state.prefill, lambda: state.prefill.pick(
                revisions={decode.revision}, costs=plan.prefill_costs), set(), deadline)
            if isinstance(prefill, Shed):
                state.decode.unpick(decode)
                return Pick(status=429, retry_after_s=prefill.retry_after_s, message=prefill.message)
            if prefill is None:
                state.metrics.fell_back_to_decode_alone()
        elif plan.skip_prefill and state.prefill.endpoints:
            state.metrics.skipped_prefill()
        pick = Pick(decode=host_port(decode.url), prefill=host_port(prefill.url) if prefill else None)
        routed = [(pool, e) for pool, e in ((state.decode, decode), (state.prefill, prefill)) if e is not None]
        for _, e in routed:
            e.outstanding += 1
        self._routed[id(pick)] = routed
        state.metrics.request("ok")
        state.metrics.hop("pick", time.monotonic() - started, error=False)
        return pick

    async def admit(self, request: PickRequest) -> Pick | None:
        """At the request's headers: 429 when every decode endpoint is saturated, or the requests in flight fill
        what the decode endpoints held when they last answered 429 (capacity.room_for: the door), and no room
        comes within the queue wait - before the gateway reads the body, and before a worker would only answer
        429 itself. None: the body's pick decides (a subset hint is the body's pick's business too)."""
        state = self.state
        if request.subset is not None or request.path.split("?", 1)[0] not in GENERATION_PATHS \
                or not state.decode.endpoints:
            return None
        shed = await room_for(state, state.decode, Deadline(state.timeouts))
        if shed is None:
            return None
        return Pick(status=429, retry_after_s=shed.retry_after_s, message=shed.message)

    def done(self, pick: Pick) -> None:
        freed = id(pick) not in self._refused
        self._refused.discard(id(pick))
        for pool, e in self._routed.pop(id(pick), ()):
            released(self.state, pool, e, freed)

    def answered(self, pick: Pick, status: int, retry_after: str | None) -> None:
        """The gateway passed on the decode's response status: a 429 saturates that endpoint (capacity.py)."""
        if status != 429 or id(pick) not in self._routed:
            return
        self._refused.add(id(pick))
        for pool, e in self._routed[id(pick)]:
            if pool is self.state.decode:
                saturated(self.state, pool, e, retry_after)

    async def _decode(self, plan: RoutePlan, subset: tuple[str, ...] | None,
                      deadline: Deadline) -> Endpoint | Shed | None:
        """The policy's pick inside the subset; with none ready, one that becomes ready within the connect
        bound (a pod starting); with every one at capacity, one with room within the queue wait, else Shed."""
        state = self.state
        outside = set() if subset is None else \
            {e.url for e in state.decode.endpoints.values() if host_port(e.url) not in subset}
        return await next_endpoint(state, state.decode, lambda: state.pick_decode(plan, outside, None), outside,
                                   deadline, wait_ready=True)


class AuthenticatingPicker:
    """A picker behind client API keys (api_keys.py): a request without one of `keys` is answered 401 by the
    gateway at once (never routed); a routed one carries the workers' key (`worker_key`) instead of the
    client's, which the workers never see. The probes' paths stay open."""

    def __init__(self, picker: Any, keys: Any, worker_key: str | None):
        self.picker, self.keys, self.worker_key = picker, keys, worker_key

    async def pick(self, request: PickRequest) -> Pick:
        path = request.path.split("?", 1)[0]
        problem = self.keys.problem(request.headers.get("authorization")) \
            if self.keys is not None and path not in OPEN_PATHS else None
        if problem is not None:
            self.picker.state.metrics.request("unauthorized")
            return Pick(status=401, message=problem)
        pick = await self.picker.pick(request)
        if pick.status == 200 and self.worker_key:
            pick.headers["authorization"] = f"Bearer {self.worker_key}"
        return pick

    async def admit(self, request: PickRequest) -> Pick | None:
        """A missing or wrong API key is refused at the headers too (the body is never read)."""
        path = request.path.split("?", 1)[0]
        if self.keys is not None and path not in OPEN_PATHS:
            problem = self.keys.problem(request.headers.get("authorization"))
            if problem is not None:
                self.picker.state.metrics.request("unauthorized")
                return Pick(status=401, message=problem)
        admit = getattr(self.picker, "admit", None)
        return None if admit is None else await admit(request)

    def done(self, pick: Pick) -> None:
        self.picker.done(pick)

    def answered(self, pick: Pick, status: int, retry_after: str | None) -> None:
        self.picker.answered(pick, status, retry_after)


def _json_object(body: bytes) -> dict[str, Any] | None:
    """The request body when it is a JSON object; else None (the worker answers the bad request itself)."""
    try:
        doc = json.loads(body) if body else None
    except (ValueError, UnicodeDecodeError):
        return None
    return doc if isinstance(doc, dict) else None
