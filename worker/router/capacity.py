"""When no endpoint can take a request now: the one place the router, the endpoint picker and the decode side's
prefill hop decide what happens, and wait.

- An endpoint that answered 429 is saturated until its Retry-After (endpoints.Endpoint.saturated_until): picks
  skip it while another endpoint can take the request. A 429 is no failure: the endpoint's health, ejection and
  readiness are left alone.
- Every available endpoint of the pool saturated: the request waits for room - a request this router sent to one
  of them finishing (one credit: the worker's queue moved by one; waiters go in arrival order), or a saturation
  running out - at most `queue_wait_s` (and what is left of the request's own bounds), with at most
  `max_queued` requests waiting at once. Past either bound it is shed: 429 with Retry-After, the time until the
  first saturation runs out (at least 1 s). A committed request - its client already has the 200 and the
  prefill's first token (the early first token) - is never shed: it waits for as long as its own bounds allow,
  since shedding it would cut an answer already started, and while one waits the pool's room is its: other
  requests wait or are shed, at the door (room_for, before any prefill) or at the hop.
- The door (room_for, before any work for a request): what an endpoint held when it answered 429 is its
  capacity (endpoints.Endpoint.door_capacity: exact for a few seconds, then growing slowly until the next 429
  sets it again, forgotten a minute after the last). While every endpoint of the pool has one, the
  router's requests for the pool - at its endpoints, in their prefill hop, committed and waiting for room - may
  not exceed their sum: one more would be refused at the decode after its prefill was spent, or queue there
  behind the others, so it waits for room at the door like the others (above). Without this, one credit opens the
  door to every request that arrives before the next 429 comes back, and under a flood the pool is sent twice
  what it can take: prefills spent on requests that then wait or are refused, and admitted requests that miss
  their deadlines.
- No endpoint ready at all: one that answers its probes "not ready" (starting) is waited for, within the connect
  bound (probes.await_ready); else the caller answers 503.
"""
from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from disagg.worker.router.endpoints import Endpoint, EndpointPool
from disagg.worker.router.probes import await_ready
from disagg.worker.router.timeouts import Deadline

if TYPE_CHECKING:
    from disagg.worker.router.state import RouterState

DEFAULT_RETRY_AFTER_S = 1  # a worker's 429 without a readable Retry-After, and the least one a shed request gets


@dataclass(frozen=True)
class Shed:
    """The request is refused for now: 429 with Retry-After."""
    retry_after_s: int
    message: str


def retry_after_of(header: str | None) -> float:
    """A worker's Retry-After (seconds; an HTTP date is not expected here), else the default."""
    try:
        seconds = float(header) if header is not None else DEFAULT_RETRY_AFTER_S
    except ValueError:
        seconds = DEFAULT_RETRY_AFTER_S
    return min(max(seconds, 0.0), 60.0)


def saturated(state: RouterState, pool: EndpointPool, ep: Endpoint, retry_after: str | None,
              refused_counted: bool = True) -> None:
    """`ep` answered 429: saturated until its Retry-After (the waiters hear when that runs out), what this
    router has in flight there its capacity at the door."""
    seconds = retry_after_of(retry_after)
    pool.mark_saturated(ep, seconds, refused_counted)
    state.metrics.saturated(pool.role)
    asyncio.get_running_loop().call_later(seconds, state.room(pool).notify_all)


def released(state: RouterState, pool: EndpointPool, ep: Endpoint, freed: bool = True) -> None:
    """A request this router sent to `ep` ended; a waiter may take the room it freed at a saturated endpoint
    (`freed` False: it was refused there, and freed nothing)."""
    if pool.released(ep, freed) or (freed and pool.door_limited()):
        state.room(pool).notify(1)


async def next_endpoint(state: RouterState, pool: EndpointPool, pick: Callable[[], Endpoint | None],
                        exclude: set[str], deadline: Deadline, wait_ready: bool = False,
                        committed: bool = False) -> Endpoint | Shed | None:
    """The endpoint to send to: pick() at once; when every available endpoint (but `exclude`) is saturated, or
    committed requests wait for room there, the first to have room within the queue wait (`committed`: within
    the request's deadline, before every other), else Shed; when none is ready and `wait_ready`, one that
    becomes ready within the connect bound; else None."""
    room = state.room(pool)
    if (committed or not room.committed_in_line) and (ep := pick()) is not None:
        return ep
    if pool.saturated_only(exclude) or (not committed and room.committed_in_line):
        return await _wait_for_room(state, pool, pick, exclude, deadline, committed)
    if wait_ready and await await_ready(state, pool, deadline):
        return pick()
    return None


async def room_for(state: RouterState, pool: EndpointPool, deadline: Deadline) -> Shed | None:
    """Shed when every endpoint of `pool` is saturated, or committed requests wait for room there, or the door
    is full (pool.door_full), and no room comes within the queue wait (nothing is picked: the router asks before
    the prefill hop, so that a request it would shed costs no prefill)."""
    room = state.room(pool)
    if not pool.saturated_only() and not room.committed_in_line and not pool.door_full(room.committed_in_line):
        return None
    got = await _wait_for_room(state, pool, lambda: _peek(pool), set(), deadline, door=True)
    return got if isinstance(got, Shed) else None  # (None: whatever comes next answers for the pool)


def _peek(pool: EndpointPool) -> Endpoint | None:
    return next(iter(pool.ranked()), None)


async def _wait_for_room(state: RouterState, pool: EndpointPool, pick: Callable[[], Endpoint | None],
                         exclude: set[str], deadline: Deadline, committed: bool = False,
                         door: bool = False) -> Endpoint | Shed | None:
    """(`door`: for room_for, where a full door blocks as saturation does.)"""
    room = state.room(pool)
    loop = asyncio.get_running_loop()
    wait_s = max(deadline.remaining(), 0.0)
    until = loop.time() + (wait_s if committed else min(room.queue_wait_s, wait_s))

    def turn() -> Endpoint | None:  # room freed goes to the committed requests first
        if door and pool.door_full(room.committed_in_line):
            return None
        return pick() if committed or not room.committed_in_line else None

    def blocked() -> bool:
        return (pool.saturated_only(exclude) or (not committed and room.committed_in_line > 0)
                or (door and pool.door_full(room.committed_in_line)))

    room.committed_in_line += committed
    try:
        if committed or room.waiting < room.max_queued:
            while (left := until - loop.time()) > 0:
                await room.wait(left, committed)
                if (ep := turn()) is not None:
                    return ep
                if not blocked():
                    break
        if (ep := turn()) is not None:
            return ep
        if not blocked():
            return None  # no longer saturated, but none available either (gone, failed): the caller's 503
    finally:
        room.committed_in_line -= committed
        if committed and not room.committed_in_line:
            room.notify_all()  # the others may have their turn
    state.metrics.request("shed")
    retry = max(DEFAULT_RETRY_AFTER_S, math.ceil(pool.saturation_ends_in(exclude)))
    return Shed(retry, f"every {pool.role} endpoint is at capacity ({len(pool.endpoints)} known); retry in "
                f"{retry} s")
