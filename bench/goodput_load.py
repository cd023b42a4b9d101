"""bench/goodput.py's workloads and load generator: requests with generated token-id prompts (no downloads; the
same ids reach both engines, so lengths are exact), sent as streaming completions, one at a time (unloaded) or
with Poisson arrivals at a rate; per request the client's TTFT and TPOT."""
from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass

import httpx

FIRST_ID, LAST_ID = 10, 700  # inside every generated tokenizer's vocabulary (768), clear of the special tokens


@dataclass(frozen=True)
class Workload:
    name: str
    prompt: tuple[int, int]  # tokens, uniform in [lo, hi] (the unique part when shared_prefix > 0)
    output: tuple[int, int]  # tokens generated (ignore_eos), uniform in [lo, hi]
    shared_prefix: int = 0  # tokens every prompt starts with, from one of `prefixes` documents
    prefixes: int = 4
    about: str = ""


WORKLOADS = {w.name: w for w in (
    Workload("long-prompt", (1000, 3000), (64, 256), about="summarisation, RAG"),
    Workload("chat", (100, 800), (100, 400), about="chat turns"),
    Workload("shared-prefix", (50, 300), (64, 256), shared_prefix=1024,
             about="one of 4 shared 1024-token documents + a 50-300-token question"),
)}


@dataclass(frozen=True)
class Req:
    prompt: list[int]
    max_tokens: int


@dataclass
class Result:
    ok: bool
    ttft: float = float("inf")  # s, request sent -> first streamed token
    tpot: float = float("inf")  # s per output token after the first
    prompt_tokens: int = 0
    error: str = ""


def requests_for(w: Workload, n: int, seed: int) -> list[Req]:
    rng = random.Random(seed)
    docs = random.Random(1234)  # the shared documents are the same in every run and round
    prefixes = [[docs.randint(FIRST_ID, LAST_ID) for _ in range(w.shared_prefix)] for _ in range(w.prefixes)]
    out = []
    for _ in range(n):
        head = rng.choice(prefixes) if w.shared_prefix else []
        body = [rng.randint(FIRST_ID, LAST_ID) for _ in range(rng.randint(*w.prompt))]
        out.append(Req(head + body, rng.randint(*w.output)))
    return out


def warmup_requests(w: Workload, copies: int) -> list[Req]:
    """Short requests that put every shared document into the prefix cache of each of `copies` workers (sent
    together, so the router spreads them), and otherwise just exercise every path once."""
    docs = requests_for(w, 200, seed=4321)
    if not w.shared_prefix:
        return docs[:2]
    firsts = {tuple(r.prompt[:w.shared_prefix]): r for r in docs}  # one request per document
    return [Req(r.prompt, 4) for r in firsts.values() for _ in range(copies)]


async def one(client: httpx.AsyncClient, url: str, model: str, req: Req, timeout_s: float) -> Result:
    body = {"model": model, "prompt": req.prompt, "max_tokens": req.max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    start = time.perf_counter()
    first = last = 0.0
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body, timeout=timeout_s) as r:
            if r.status_code != 200:
                return Result(False, prompt_tokens=len(req.prompt),
                              error=f"HTTP {r.status_code}: {(await r.aread()).decode()[:200]}")
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return Result(False, prompt_tokens=len(req.prompt), error=str(chunk["error"])[:200])
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    last = time.perf_counter()
                    first = first or last
    except (httpx.HTTPError, asyncio.TimeoutError) as e:
        return Result(False, prompt_tokens=len(req.prompt), error=f"{type(e).__name__}: {e}"[:200])
    if not first:
        return Result(False, prompt_tokens=len(req.prompt), error="no token streamed")
    # ignore_eos: exactly max_tokens come out, however the server groups them into chunks
    return Result(True, first - start, (last - first) / max(req.max_tokens - 1, 1), len(req.prompt))


async def _unloaded(url: str, model: str, reqs: list[Req], timeout_s: float) -> list[Result]:
    async with httpx.AsyncClient() as client:
        out = []
        for req in reqs:
            out.append(await one(client, url, model, req, timeout_s))
            await asyncio.sleep(0.05)  # let the workers go idle (KV frees, the prefill's lease notifications)
        return out


def unloaded(url: str, model: str, reqs: list[Req], timeout_s: float = 120) -> list[Result]:
    """One request at a time: the latencies with nothing else in the system."""
    return asyncio.run(_unloaded(url, model, reqs, timeout_s))


async def _poisson(url: str, model: str, reqs: list[Req], rate: float, seed: int, drain_s: float) -> list[Result]:
    rng = random.Random(seed)
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=1024, max_keepalive_connections=256)) as client:
        tasks = []
        for req in reqs:
            tasks.append(asyncio.ensure_future(one(client, url, model, req, timeout_s=drain_s + 600)))
            await asyncio.sleep(rng.expovariate(rate))
        done, pending = await asyncio.wait(tasks, timeout=drain_s)
        for t in pending:  # still running drain_s after the last arrival: counted as missing both SLOs
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    return [t.result() if t in done else Result(False, prompt_tokens=len(r.prompt), error="unfinished at drain")
            for t, r in zip(tasks, reqs)]


def poisson(url: str, model: str, reqs: list[Req], rate: float, seed: int, drain_s: float = 60) -> list[Result]:
    """Requests with exponential gaps (mean 1/rate); whatever is unfinished `drain_s` after the last arrival is
    cut off and fails."""
    return asyncio.run(_poisson(url, model, reqs, rate, seed, drain_s))
