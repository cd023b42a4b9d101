"""Subscriptions to the workers' KV-cache events (ZMQ SUB, vLLM's wire format, framed as wire.py says), feeding
an index of what each worker caches (the router's KVIndex: any EventSink).

Every ready endpoint of either pool that publishes events gets one subscriber task: where it publishes comes from
its GET /kv_events (our workers), else from what the router was told (EventsDirectory: the endpoints file of
`disagg up`, or the fixed ports of the operator's pods at the endpoint URL's host - vLLM serves no /kv_events).
An endpoint that turns unready or leaves the pool is unsubscribed and dropped from the index (a restarted worker
starts over empty). On a gap in the sequence the subscriber asks the worker's replay socket for what it missed
before applying more.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Callable, Protocol
from urllib.parse import urlparse

import httpx
import msgspec
import zmq
import zmq.asyncio

from disagg.worker.kv_events import wire
from disagg.worker.kv_events.schema import KVCacheEvent, decode_batch
from disagg.worker.kv_events.wire import Applied

logger = logging.getLogger(__name__)

REPLAY_TIMEOUT_MS = 2000
NO_EVENTS_RETRY_S = 30.0  # an endpoint without /kv_events (events off, or vLLM) is asked again after this


class EventSink(Protocol):
    """Where the batches go, per worker URL: it keeps each worker's last sequence number (wire.sequence_outcome)."""

    def apply(self, url: str, seq: int, events: Iterable[KVCacheEvent], replayed: bool = False
              ) -> tuple[Applied, int]: ...

    def last_seq(self, url: str) -> int | None: ...

    def drop(self, url: str) -> None: ...


class EventCounts(Protocol):
    """The subscriber's counters (the router's metrics)."""

    def kv_events_received(self, n: int) -> None: ...

    def kv_events_lost(self, n: int) -> None: ...


def subscriber_address(worker_url: str, bound: str) -> str:
    """The worker's bound ZMQ address as reachable from here: a wildcard host becomes the worker URL's host."""
    head, _, port = bound.rpartition(":")
    host = head.removeprefix("tcp://").strip("[]")
    if host in ("0.0.0.0", "*", "::", ""):
        host = urlparse(worker_url).hostname or "127.0.0.1"
    return f"tcp://{host}:{port}"


@dataclass(frozen=True)
class EventsDirectory:
    """Where endpoints that serve no GET /kv_events publish: `announced(url)` (the endpoints file's entry), else
    the fixed `port`/`replay_port` at the URL's host (the operator's pods). Neither: no events."""
    port: int | None = None
    replay_port: int | None = None
    topic: str = ""
    announced: Callable[[str], dict[str, Any] | None] | None = None

    def info(self, url: str) -> dict[str, Any] | None:
        if self.announced is not None and (info := self.announced(url)) is not None:
            return info
        if self.port is None:
            return None
        host = urlparse(url).hostname or "127.0.0.1"
        host = f"[{host}]" if ":" in host else host
        replay = f"tcp://{host}:{self.replay_port}" if self.replay_port else None
        return {"endpoint": f"tcp://{host}:{self.port}", "replay_endpoint": replay, "topic": self.topic}


class EndpointSubscriber:
    """One worker's event stream into the index."""

    def __init__(self, url: str, info: dict[str, Any], index: EventSink, metrics: EventCounts,
                 ctx: zmq.asyncio.Context):
        self.url, self.index, self.metrics, self.ctx = url, index, metrics, ctx
        self.topic = str(info.get("topic") or "").encode()
        self.endpoint = subscriber_address(url, info["endpoint"])
        replay = info.get("replay_endpoint")
        self.replay_endpoint = subscriber_address(url, replay) if replay else None
        self._replayed_upto: int | None = None  # live batches up to here were applied by a replay

    async def run(self) -> None:
        sub = self.ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        sub.connect(self.endpoint)
        logger.info("subscribed to KV events of %s at %s", self.url, self.endpoint)
        try:
            if self.replay_endpoint:  # catch up on what the worker cached before we came
                await self._replay(0)
            while True:
                frames = await sub.recv_multipart()
                if (message := wire.parse_live(frames)) is None:
                    logger.warning("KV events from %s: malformed message (%d frames)", self.url, len(frames))
                    continue
                seq, payload = message
                if self._replayed_upto is not None:
                    if seq <= self._replayed_upto:
                        continue  # seen in the replay
                    self._replayed_upto = None
                last = self.index.last_seq(self.url)
                if self.replay_endpoint and last is not None and seq > last + 1:
                    await self._replay(last + 1)
                    if self._replayed_upto is not None and seq <= self._replayed_upto:
                        continue
                self._apply(seq, payload, replayed=False)
        finally:
            sub.close(linger=0)

    def _apply(self, seq: int, payload: bytes, replayed: bool) -> None:
        try:
            batch = decode_batch(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            logger.warning("KV events from %s: undecodable batch %d: %s", self.url, seq, e)
            self.metrics.kv_events_lost(1)
            return
        outcome, lost = self.index.apply(self.url, seq, batch.events, replayed=replayed)
        if outcome is Applied.DUPLICATE:
            return
        self.metrics.kv_events_received(len(batch.events))
        if outcome is Applied.GAP and lost:
            logger.warning("KV events from %s: %d batches lost before %d; its index starts over", self.url,
                           lost, seq)
            self.metrics.kv_events_lost(lost)
        elif outcome is Applied.RESET:
            logger.info("KV events from %s: sequence went back to %d (restarted); its index starts over",
                        self.url, seq)

    async def _replay(self, start: int) -> None:
        """Apply the worker's buffered batches from `start` on."""
        sock = self.ctx.socket(zmq.DEALER)
        sock.connect(self.replay_endpoint)
        try:
            await sock.send_multipart(wire.replay_request(start))
            while True:
                if not await sock.poll(REPLAY_TIMEOUT_MS):
                    logger.warning("KV events replay from %s timed out", self.url)
                    return
                if (answer := wire.parse_replay_answer(await sock.recv_multipart())) is None:
                    logger.warning("KV events replay from %s: malformed answer", self.url)
                    return
                seq, payload = answer
                if seq == wire.END_OF_REPLAY:
                    return
                self._apply(seq, payload, replayed=True)
                self._replayed_upto = seq
        finally:
            sock.close(linger=0)


class KVEventSubscriptions:
    """Keeps one EndpointSubscriber per ready endpoint that publishes events."""

    def __init__(self, index: EventSink, metrics: EventCounts, clock: Any = None,
                 directory: EventsDirectory | None = None):
        self.index, self.metrics = index, metrics
        self.directory = directory or EventsDirectory()
        self.ctx = zmq.asyncio.Context()
        self.tasks: dict[str, asyncio.Task] = {}  # url -> subscriber task
        self._no_events: dict[str, float] = {}  # url -> when it said it publishes none
        self._clock = clock or (lambda: asyncio.get_running_loop().time())

    async def sync_once(self, pools: list[Any], client: httpx.AsyncClient) -> None:
        ready = {url for pool in pools for url, ep in pool.endpoints.items() if ep.ready}
        for url, task in list(self.tasks.items()):
            if url not in ready or task.done():
                if task.done() and not task.cancelled() and task.exception() is not None:
                    logger.warning("KV events subscriber of %s failed: %r", url, task.exception())
                task.cancel()
                del self.tasks[url]
                self.index.drop(url)
        now = self._clock()
        for url in sorted(ready - set(self.tasks)):
            if now - self._no_events.get(url, -NO_EVENTS_RETRY_S) < NO_EVENTS_RETRY_S:
                continue
            info = await _events_info(client, url) or self.directory.info(url)
            if info is None:
                self._no_events[url] = now
                continue
            self._no_events.pop(url, None)
            sub = EndpointSubscriber(url, info, self.index, self.metrics, self.ctx)
            self.tasks[url] = asyncio.ensure_future(sub.run())

    def close(self) -> None:
        for task in self.tasks.values():
            task.cancel()
        self.tasks.clear()
        self.ctx.destroy(linger=0)


async def _events_info(client: httpx.AsyncClient, url: str) -> dict[str, Any] | None:
    try:
        r = await client.get(f"{url}/kv_events", timeout=2.0)
    except httpx.HTTPError:
        return None
    if r.status_code != 200:
        return None
    try:
        info = r.json()
    except ValueError:
        return None
    return info if isinstance(info, dict) and isinstance(info.get("endpoint"), str) else None
