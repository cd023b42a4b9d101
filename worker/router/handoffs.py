"""The KV hand-offs the router has seen, per endpoint: what every request's P/D hops tell, whatever the engine.

vLLM exports no gauge of KV waiting at a prefill pod to be pulled, nor of requests waiting at a decode pod for
remote KV (ours does: disagg:kv_pending_sends / disagg:kv_pending_loads). The router sees both ends of each
hand-off, so it measures them for any engine:
  - a pending send: the prefill's answer named KV (a hand-off) and no decode has answered with it yet; it stops
    being pending when a decode endpoint's first byte comes back for it, or at its lease end (the prefill frees
    unread KV then; a hand-off without a lease is given DEFAULT_LEASE_S);
  - a pending load: a decode hop carrying a hand-off, sent and not answered yet (its first byte);
  - hand-off -> first decode token: from the prefill's answer to that first byte.
A hand-off that no decode took (every decode hop refused it before its engine saw it, or none was tried) is
`unread` once its request is over: the router asks its prefill to free the KV now (hops.release_unread) rather
than at the lease end. One that a decode hop carried and lost (a timeout, a reset, a 5xx: that decode may be
reading it) is never released early.
Per endpoint: the count and the age of the oldest (metrics.py exports them with the endpoint's pod name).
Pure bookkeeping with an injected clock; the hops (hops.py) report to it.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from disagg.worker.kv_transfer.handoff import Handoff

DEFAULT_LEASE_S = 30.0  # the workers' default (--kv-lease-seconds), for a hand-off that names no lease end


@dataclass
class Ticket:
    """One hand-off as the router follows it."""
    prefill_url: str
    handed_at: float  # monotonic: when the prefill's answer came
    expires_at: float  # monotonic: its lease end
    maybe_read: bool = False  # a decode hop that carried it failed without saying it refused it
    handoff: Handoff | None = None  # the hand-off itself: what a release call gives back to its prefill


@dataclass
class HandoffLedger:
    clock: Callable[[], float] = time.monotonic
    wall: Callable[[], float] = time.time
    sends: dict[str, Ticket] = field(default_factory=dict)  # ticket id -> the hand-off, while pending
    loads: dict[str, tuple[str, float]] = field(default_factory=dict)  # ticket id -> (decode url, sent at)
    cannot_release: set[str] = field(default_factory=set)  # prefill urls without a release call (vLLM: 501)

    def handed_off(self, ticket: str, prefill_url: str, lease_expires_at: float | None,
                   handoff: Handoff | None = None) -> None:
        now = self.clock()
        left = lease_expires_at - self.wall() if lease_expires_at is not None else DEFAULT_LEASE_S
        self.sends[ticket] = Ticket(prefill_url, now, now + max(left, 0.0), handoff=handoff)

    def decode_sent(self, ticket: str, decode_url: str) -> None:
        self.loads[ticket] = (decode_url, self.clock())

    def decode_failed(self, ticket: str, maybe_read: bool = False) -> None:
        """The hop failed before its first byte: no longer loading there (the KV may go to another decode).
        maybe_read: the decode did not say it refused the hand-off (a timeout, a reset, a 5xx)."""
        self.loads.pop(ticket, None)
        if maybe_read and (send := self.sends.get(ticket)) is not None:
            send.maybe_read = True

    def unread(self, ticket: str) -> Ticket | None:
        """The hand-off, when its request is over and no decode may read its KV: none holds it now and every
        one that did refused it. None otherwise (consumed, past its lease, or maybe being read); a hop still
        open with it (its request was cancelled) is closed as one that may have read it."""
        if ticket in self.loads:
            self.decode_failed(ticket, maybe_read=True)
        send = self.sends.get(ticket)
        if send is None or send.maybe_read or send.expires_at <= self.clock():
            return None
        return send

    def released(self, ticket: str) -> None:
        """Its prefill freed the KV (release call answered)."""
        self.sends.pop(ticket, None)

    def decode_answered(self, ticket: str) -> float | None:
        """The decode's first byte came: the KV was consumed. Seconds from the hand-off, when it was pending."""
        self.loads.pop(ticket, None)
        send = self.sends.pop(ticket, None)
        return self.clock() - send.handed_at if send is not None else None

    def pending(self) -> tuple[dict[str, tuple[int, float]], dict[str, tuple[int, float]]]:
        """({prefill url: (pending sends, oldest's age s)}, {decode url: (pending loads, oldest's age s)});
        hand-offs past their lease are dropped (their prefill freed the KV)."""
        now = self.clock()
        for ticket in [t for t, s in self.sends.items() if s.expires_at <= now]:
            del self.sends[ticket]
        return _by_endpoint([(s.prefill_url, s.handed_at) for s in self.sends.values()], now), \
            _by_endpoint(list(self.loads.values()), now)


def _by_endpoint(entries: list[tuple[str, float]], now: float) -> dict[str, tuple[int, float]]:
    out: dict[str, tuple[int, float]] = {}
    for url, since in entries:
        n, oldest = out.get(url, (0, 0.0))
        out[url] = (n + 1, max(oldest, now - since))
    return out
