"""What the router's parts share (the HTTP app, the hops, the probes): the two pools, the policy's plan for a
request, the picks that pair revisions, and what a failed hop does to its endpoint. A gateway's endpoint picker
or a decode-side hop holds one too (pools from discovery, its own client and metrics)."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import httpx

from disagg.worker.router.draining import Drain
from disagg.worker.router.endpoints import Endpoint, EndpointPool
from disagg.worker.router.handoffs import HandoffLedger
from disagg.worker.router.metrics import RouterMetrics
from disagg.worker.router.policy import RoutePlan, RoutingPolicy
from disagg.worker.router.timeouts import HopTimeout, HopTimeouts
from disagg.worker.router.waiting_room import WaitingRoom

if TYPE_CHECKING:
    from disagg.worker.router.hold import HoldQueue
    from disagg.worker.router.prefix_router import PrefixRouter

logger = logging.getLogger(__name__)


@dataclass
class RouterState:
    prefill: EndpointPool
    decode: EndpointPool
    metrics: RouterMetrics
    client: httpx.AsyncClient | None = None  # the hops' (and the calls they make on a request's behalf)
    # the probes' and /metrics scrapes': a pool of their own, so that a full hop pool never delays them (None: the
    # hops' client, as in tests that build a state by hand)
    probe_client: httpx.AsyncClient | None = None
    probe_interval_s: float = 1.0
    timeouts: HopTimeouts = field(default_factory=HopTimeouts)
    early_first_token: bool = True  # stream the prefill's token before the decode hop (early_first_chunk)
    prefix: PrefixRouter | None = None  # a policy's prefix facts (prefix_router.py) when it reads them, else None
    handoffs: HandoffLedger = field(default_factory=HandoffLedger)  # KV hand-offs pending per endpoint
    hold: HoldQueue | None = None  # requests waiting for a decode endpoint (hold.py); None: not held
    queue_wait_s: float | None = None  # how long a request waits for room at a saturated pool (None: the default)
    max_queued: int | None = None  # how many may wait at once, per pool (None: the default)
    rooms: dict[str, WaitingRoom] = field(default_factory=dict)  # role -> its waiting room (capacity.py)
    # generation requests past the door at once: at most this many per available decode endpoint, and
    # in_flight_ceiling in all (app.RefuseAtTheDoor; 0: no bound per endpoint); in_flight counts them
    max_in_flight_per_endpoint: int = 0
    in_flight_ceiling: int | None = None
    in_flight: int = 0
    drain: Drain = field(default_factory=Drain)  # the shutdown's state (draining.py)
    down: dict[str, str] = field(default_factory=dict)  # background task -> why it is down (supervision.py)

    def room(self, pool: EndpointPool) -> WaitingRoom:
        if pool.role not in self.rooms:
            bounds = {k: v for k, v in (("queue_wait_s", self.queue_wait_s), ("max_queued", self.max_queued))
                      if v is not None}
            self.rooms[pool.role] = WaitingRoom(**bounds)
        return self.rooms[pool.role]

    def in_flight_bound(self) -> int | None:
        """How many generation requests may be past the door at once (None: no bound)."""
        if not self.max_in_flight_per_endpoint:
            return self.in_flight_ceiling
        bound = self.max_in_flight_per_endpoint * max(len(self.decode.available()), 1)
        return bound if self.in_flight_ceiling is None else min(bound, self.in_flight_ceiling)

    @property
    def probes(self) -> httpx.AsyncClient | None:
        """The client probes and scrapes go out on."""
        return self.probe_client or self.client

    def members(self) -> list[tuple[str, str, str]]:
        """(role, url, pod name or host:port) of every endpoint, for the per-endpoint metrics."""
        return [(pool.role, e.url, e.name or e.url.split("://", 1)[-1])
                for pool in (self.prefill, self.decode) for e in pool.endpoints.values()]

    @property
    def policy(self) -> RoutingPolicy:
        return self.decode.policy  # one policy for both pools

    async def plan(self, body: dict[str, Any], path: str) -> RoutePlan:
        """The policy's plan for one request: from the prompt's cached prefixes where the policy reads them and
        the prompt can be told, else from the endpoints' load alone."""
        if self.prefix is not None and (plan := await self.prefix.plan_request(
                body, path, self.prefill, self.decode, self.client)) is not None:
            return plan
        return self.policy.plan(None, [e.candidate() for e in self.decode.available()],
                                [e.candidate() for e in self.prefill.available()])

    def pick_prefill(self, plan: RoutePlan, tried: set[str]) -> Endpoint | None:
        """Prefill endpoints whose revision has a ready decode endpoint go first."""
        return self.prefill.pick(tried, revisions=self.decode.ready_revisions(), costs=plan.prefill_costs)

    def pick_decode(self, plan: RoutePlan, tried: set[str], revisions: set[str | None] | None) -> Endpoint | None:
        """revisions: the prefill's serving revision, whose KV fits (any decode endpoint when none is left)."""
        return self.decode.pick(tried, revisions=revisions, costs=plan.decode_costs)

    def hop_failed(self, pool: EndpointPool, ep: Endpoint, hop: str, start: float, why: str,
                   timed_out: bool = False) -> None:
        logger.warning("%s hop to %s failed: %s", hop, ep.url, why)
        self.metrics.hop(hop, time.monotonic() - start, error=True)
        self.tell_ejection(hop, ep, pool.mark_failed(ep, timed_out))

    def hop_timed_out(self, pool: EndpointPool, ep: Endpoint, hop: str, start: float, e: HopTimeout) -> None:
        self.metrics.timed_out(hop, e.stage)
        self.hop_failed(pool, ep, hop, start, f"timed out ({e.stage}): {e}", timed_out=True)

    def tell_ejection(self, hop: str, ep: Endpoint, ejected_s: float | None) -> None:
        """Tell an ejection mark_failed just made (None: none)."""
        if ejected_s is not None:
            logger.warning("%s endpoint %s ejected for %g s (ejection %d in a row)", hop, ep.url, ejected_s,
                           ep.health.ejections)
            self.metrics.ejected(hop)
