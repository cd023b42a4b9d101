"""The router's ledger of KV hand-offs (engine-agnostic pending sends and loads) and its per-endpoint gauges."""
from __future__ import annotations

from disagg.worker.router.endpoints import EndpointPool
from disagg.worker.router.handoffs import DEFAULT_LEASE_S, HandoffLedger
from disagg.worker.router.metrics import RouterMetrics
from disagg.worker.router.state import RouterState


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def ledger(clock: Clock) -> HandoffLedger:
    return HandoffLedger(clock=clock, wall=lambda: 1_000.0 + clock.now)


def test_a_hand_off_is_pending_at_its_prefill_until_a_decode_answers_with_it():
    clock = Clock()
    book = ledger(clock)
    book.handed_off("t1", "http://p1", lease_expires_at=1_000.0 + 130.0)  # 30 s of lease left
    book.decode_sent("t1", "http://d1")
    clock.now += 2
    assert book.pending() == ({"http://p1": (1, 2.0)}, {"http://d1": (1, 2.0)})
    book.decode_failed("t1")  # the hop failed before its first byte: the KV still waits at p1
    assert book.pending() == ({"http://p1": (1, 2.0)}, {})
    book.decode_sent("t1", "http://d2")
    clock.now += 1
    assert book.decode_answered("t1") == 3.0
    assert book.pending() == ({}, {})
    assert book.decode_answered("t1") is None  # once


def test_a_hand_off_no_decode_took_stops_being_pending_at_its_lease_end():
    clock = Clock()
    book = ledger(clock)
    book.handed_off("t1", "http://p1", lease_expires_at=1_000.0 + 105.0)  # 5 s left
    book.handed_off("t2", "http://p1", lease_expires_at=None)  # no lease named: the workers' default
    clock.now += 5
    assert book.pending()[0] == {"http://p1": (1, 5.0)}
    clock.now += DEFAULT_LEASE_S
    assert book.pending() == ({}, {})


def test_the_gauges_name_every_endpoint_with_its_pod_and_read_zero_when_idle():
    clock = Clock()
    prefill, decode = EndpointPool("prefill"), EndpointPool("decode")
    prefill.set_urls(["http://10.0.0.1:8000", "http://10.0.0.2:8000"], names={"http://10.0.0.1:8000": "x-prefill-a"})
    decode.set_urls(["http://10.0.0.3:8000"], names={"http://10.0.0.3:8000": "x-decode-a"})
    metrics = RouterMetrics("m")
    state = RouterState(prefill, decode, metrics, handoffs=ledger(clock))
    metrics.watch_handoffs(state.handoffs, state.members)
    state.handoffs.handed_off("t1", "http://10.0.0.1:8000", None)
    state.handoffs.decode_sent("t1", "http://10.0.0.3:8000")
    clock.now += 4
    page = metrics.render().decode()
    assert ('disagg:router_kv_pending_sends{endpoint="http://10.0.0.1:8000",endpoint_pod="x-prefill-a",'
            'model_name="m",role="router"} 1.0') in page
    assert ('disagg:router_kv_pending_sends{endpoint="http://10.0.0.2:8000",endpoint_pod="10.0.0.2:8000",'
            'model_name="m",role="router"} 0.0') in page
    assert ('disagg:router_kv_oldest_pending_load_seconds{endpoint="http://10.0.0.3:8000",endpoint_pod='
            '"x-decode-a",model_name="m",role="router"} 4.0') in page
    assert "disagg:router_kv_pending_loads{" in page and 'endpoint="http://10.0.0.1:8000"' not in \
        [line for line in page.splitlines() if line.startswith("disagg:router_kv_pending_loads{")][0]


def test_only_a_hand_off_every_decode_refused_is_released_early():
    """The router frees a hand-off's KV before its lease only when no decode may be reading it: never sent, or
    refused by every decode it went to. One whose hop timed out or broke (or is still open: the client left) may
    be read at that decode, and waits for its lease."""
    clock = Clock()
    book = ledger(clock)
    for t in ("never-sent", "refused", "timed-out", "left", "consumed", "expired"):
        book.handed_off(t, "http://p1", lease_expires_at=1_000.0 + 130.0)
    book.decode_sent("refused", "http://d1")
    book.decode_failed("refused")  # a 429, or a 4xx naming the hand-off
    book.decode_sent("timed-out", "http://d1")
    book.decode_failed("timed-out", maybe_read=True)
    book.decode_sent("left", "http://d1")  # the request was cancelled with its hop open
    book.decode_sent("consumed", "http://d1")
    book.decode_answered("consumed")
    assert book.unread("never-sent").prefill_url == "http://p1"
    assert book.unread("refused") is not None
    assert book.unread("timed-out") is None and book.unread("consumed") is None
    assert book.unread("left") is None and book.pending()[1] == {}  # its load no longer counted either
    book.released("refused")
    assert book.unread("refused") is None and "refused" not in book.sends
    clock.now += 31
    assert book.unread("expired") is None  # its prefill freed it at the lease end
