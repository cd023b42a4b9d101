"""Helpers of the overload and lifecycle fault tests (tests/faults/test_router_restart.py, test_router_partition.py,
test_slowloris.py, test_flood.py, test_kv_exhausted.py): streams read to their end and told apart (the whole
answer, a clear error event, or a cut), a load generator with Poisson arrivals that records each request's status
and time to first token, and the percentiles the assertions read."""
from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from collections.abc import Awaitable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

import serving_fleet
from ctl_fixtures import LEASE_S

PROMPT = "The harbour market opened before dawn and the fishermen sold"


@contextlib.contextmanager
def pd_fleet(log_dir: Path, model: str, worker_flags: list[str] | None = None, router_flags: tuple[str, ...] = (),
             prefill_extra: tuple[str, ...] = (), decode_extra: tuple[str, ...] = (),
             connector: str = "SharedStorageConnector") -> Iterator[dict]:
    """1 prefill + 1 decode worker (SharedStorageConnector unless `connector` says, a short lease) and the router,
    on loopback; stopped at the end, every process but those a test killed (fleet.killed) exiting 0."""
    fleet = serving_fleet.Fleet(log_dir, worker_flags)
    prefill = fleet.worker("prefill-0", "prefill", model, connector, lease_s=LEASE_S, extra=prefill_extra)
    decode = fleet.worker("decode-0", "decode", model, connector, lease_s=LEASE_S, extra=decode_extra)
    fleet.wait_ready()
    router = fleet.router([prefill], [decode], tuple(router_flags))
    fleet.wait_ready()
    yield {"fleet": fleet, "router": router, "prefill": prefill, "decode": decode, "workers": [prefill, decode]}
    codes = fleet.stop()
    assert {n: c for n, c in codes.items() if n not in fleet.killed} == \
        {n: 0 for n in codes if n not in fleet.killed}, codes


def body(max_tokens: int, stream: bool = True, prompt: str = PROMPT) -> dict:
    return {"model": "tiny-llama", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": stream, **({"stream_options": {"include_usage": True}} if stream else {})}


@dataclass
class StreamEnd:
    """How one streamed answer ended: 'whole' (every token, [DONE]), 'error' (an SSE error event, then [DONE]),
    'status' (no stream: an HTTP error status), or 'cut' (the connection broke: the client sees no [DONE])."""
    kind: str
    tokens: int = 0  # completion tokens the usage chunk reported
    error: dict | None = None  # the error event's or the status's body
    status: int = 200
    seconds: float = 0.0  # from the request to its end


def read_stream(url: str, payload: dict, timeout: float = 120.0) -> StreamEnd:
    start = time.monotonic()
    events: list[str] = []
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=payload, timeout=timeout) as r:
            if r.status_code != 200:
                r.read()
                return StreamEnd("status", error=r.json().get("error"), status=r.status_code,
                                 seconds=time.monotonic() - start)
            if not r.headers["content-type"].startswith("text/event-stream"):  # not streamed: one JSON answer
                r.read()
                return StreamEnd("whole", tokens=r.json()["usage"]["completion_tokens"],
                                 seconds=time.monotonic() - start)
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
    except httpx.HTTPError:
        return StreamEnd("cut", seconds=time.monotonic() - start)
    took = time.monotonic() - start
    if not events or events[-1] != "[DONE]":
        return StreamEnd("cut", seconds=took)
    chunks = [json.loads(e) for e in events[:-1]]
    errors = [c["error"] for c in chunks if "error" in c]
    if errors:
        return StreamEnd("error", error=errors[-1], seconds=took)
    usage = [c["usage"] for c in chunks if c.get("usage")]
    return StreamEnd("whole", tokens=usage[-1]["completion_tokens"] if usage else 0, seconds=took)


@dataclass
class Sent:
    """One request of a load: what came of it so far (filled in as it goes, so an unfinished one says how far)."""
    status: int = 0  # 0: no answer (no response headers)
    ttft: float | None = None  # seconds to the first streamed token
    error_event: bool = False  # a 200 stream that ended with an error event
    retry_after: str | None = None
    done: bool = False  # the answer ended ([DONE] or the whole error body)
    failure: str = ""  # the client's exception, e.g. ConnectTimeout, RemoteProtocolError
    left: bool = False  # the client left before its answer ended (offer's leave_within_s)


async def _one(client: httpx.AsyncClient, url: str, payload: dict, sent: Sent | None = None) -> Sent:
    sent = sent if sent is not None else Sent()
    start = time.monotonic()
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=payload) as r:
            sent.status = r.status_code
            if r.status_code != 200:
                await r.aread()
                sent.retry_after, sent.done = r.headers.get("retry-after"), True
                return sent
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    if sent.ttft is None:
                        sent.ttft = time.monotonic() - start
                    sent.error_event = sent.error_event or '"error"' in line
                elif line == "data: [DONE]":
                    sent.done = True
            return sent
    except httpx.HTTPError as e:
        sent.failure = type(e).__name__
        return sent


async def _leave_after(answer: Awaitable[Sent], seconds: float, sent: Sent) -> Sent:
    try:
        return await asyncio.wait_for(answer, seconds)
    except (TimeoutError, asyncio.TimeoutError):
        sent.left = True
        return sent


async def offer(url: str, rate: float, seconds: float, payload: dict, grace_s: float = 60.0,
                seed: int = 0, leave_within_s: float | None = None) -> list[Sent]:
    """Poisson arrivals at `rate` per second for `seconds`; what is unfinished `grace_s` later is given up (its
    Sent says how far it got). `leave_within_s`: each client leaves after a random 0..leave_within_s seconds
    unless its answer ended first."""
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=100)
    sent: list[Sent] = []
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(seconds + grace_s, connect=10)) as client:
        tasks, t0 = [], time.monotonic()
        while time.monotonic() - t0 < seconds:
            sent.append(Sent())
            answer = _one(client, url, payload, sent[-1])
            if leave_within_s is not None:
                answer = _leave_after(answer, rng.uniform(0.0, leave_within_s), sent[-1])
            tasks.append(asyncio.ensure_future(answer))
            await asyncio.sleep(rng.expovariate(rate))
        _, pending = await asyncio.wait(tasks, timeout=grace_s)
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    return sent


def closed_loop(url: str, concurrency: int, seconds: float, payload: dict) -> float:
    """Completed requests per second with `concurrency` clients sending back to back: the capacity."""
    async def client_loop(client: httpx.AsyncClient, until: float) -> int:
        n = 0
        while time.monotonic() < until:
            if (s := await _one(client, url, payload)).status == 200 and s.done:
                n += 1
        return n

    async def run() -> float:
        async with httpx.AsyncClient(timeout=120) as client:
            await asyncio.gather(*(_one(client, url, payload) for _ in range(concurrency)))  # warm: not counted
            t0 = time.monotonic()
            counts = await asyncio.gather(*(client_loop(client, t0 + seconds) for _ in range(concurrency)))
            return sum(counts) / (time.monotonic() - t0)

    return asyncio.run(run())


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(int(q * len(values)), len(values) - 1)] if values else float("nan")
