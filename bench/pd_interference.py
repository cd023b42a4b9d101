"""Interference of KV pulls with decoding (issue 17): steady decode streams on one decode worker, measured
client-side as inter-token latency (ITL), without and then with long prompts (~2k tokens) arriving through P/D,
whose KV the decode worker READs over NIXL from a prefill worker while it keeps decoding the streams.

The prefill hops run before each phase (their params carry a long lease), so the phase with pulls adds only
what the decode worker does for them - the READ and the pulled request joining the batch - and not the prefill's
compute competing for the same two cores. Prints ITL p50/p99 of both phases and their ratio (target p99 <= 1.2x).

    python bench/pd_serving.py --interference [--streams 4] [--pulls 12] [--pull-interval 0.5]

p99 over every token of every stream dilutes short stalls (a pull touches one token per stream); p99.9 and
max show them too.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from disagg.worker.local.process import free_port, is_ready

CLI = [sys.executable, "-m", "disagg.worker.cli"]
WORDS = "the history of the city begins with a small harbour and a market where fishermen sold fish".split()


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("interference case (--interference)")
    g.add_argument("--interference", action="store_true", help="run the KV-pull interference case instead")
    g.add_argument("--streams", type=int, default=4, help="steady decode streams on the decode worker")
    g.add_argument("--stream-tokens", type=int, default=160, help="tokens per stream request (each stream repeats them for the whole phase)")
    g.add_argument("--pulls", type=int, default=12, help="~2k-token P/D requests during the phase with pulls")
    g.add_argument("--pull-interval", type=float, default=0.5, help="seconds between P/D requests")
    g.add_argument("--pull-tokens", type=int, default=1900, help="prompt tokens of each P/D request (about)")
    g.add_argument("--rounds", type=int, default=2, help="alternating without/with rounds")


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(int(q * len(values)), len(values) - 1)] if values else float("nan")


def start_worker(tmp: Path, role: str, model_dir: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    argv = [*CLI, "worker", "--role", role, "--model", model_dir, "--served-model-name", "tiny-llama", "--host",
            "127.0.0.1", "--port", str(port), "--dtype", "float32", "--max-model-len", "2048",
            "--num-kv-blocks", "2048", "--no-prefix-caching", "--kv-connector", "NixlConnector",
            "--kv-lease-seconds", "300", "--kv-side-channel-host", "127.0.0.1",
            "--kv-side-channel-port", str(free_port())]
    proc = subprocess.Popen(argv, stdout=(tmp / f"interference-{role}.log").open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while not is_ready(url):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"{role} worker did not become ready; see {tmp}/interference-{role}.log")
        time.sleep(0.2)
    return proc, url


async def stream_until(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int, end: float) -> list[float]:
    """Back-to-back streams until perf_counter() passes `end`: a steady decode load for the whole phase."""
    itls: list[float] = []
    while time.perf_counter() < end:
        itls += await stream_itls(client, url, prompt, max_tokens)
    return itls


async def stream_itls(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int) -> list[float]:
    body = {"model": "tiny-llama", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    times: list[float] = []
    async with client.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"]:
                times.append(time.perf_counter())
    return [b - a for a, b in zip(times[1:], times[2:])]  # from the 2nd token: the first is admission


async def prefill_hops(client: httpx.AsyncClient, prefill: str, n: int, words: int, tag: str) -> list[tuple]:
    out = []
    for i in range(n):
        prompt = f"{tag} {i} " + " ".join(WORDS[(i + j) % len(WORDS)] for j in range(words))
        r = await client.post(f"{prefill}/v1/completions", timeout=300, json={
            "model": "tiny-llama", "prompt": prompt, "max_tokens": 1, "temperature": 0,
            "kv_transfer_params": {"do_remote_decode": True}})
        r.raise_for_status()
        out.append((prompt, r.json()["kv_transfer_params"]))
    return out


async def phase(decode: str, prefill: str, args: argparse.Namespace, with_pulls: bool, tag: str) -> dict:
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=64)) as client:
        # ~2.4 tokens per word with the tiny tokenizer
        hops = await prefill_hops(client, prefill, args.pulls, int(args.pull_tokens / 2.4), tag) if with_pulls else []
        end = time.perf_counter() + 2.0 + args.pulls * args.pull_interval  # same length with and without pulls
        streams = [asyncio.create_task(stream_until(client, decode, f"stream {tag} {i} " + " ".join(WORDS),
                                                    args.stream_tokens, end)) for i in range(args.streams)]
        await asyncio.sleep(1.0)  # the streams are decoding before the first pull arrives
        pulls = []
        for prompt, params in hops:
            pulls.append(asyncio.create_task(client.post(f"{decode}/v1/completions", timeout=300, json={
                "model": "tiny-llama", "prompt": prompt, "max_tokens": 2, "temperature": 0,
                "kv_transfer_params": params})))
            await asyncio.sleep(args.pull_interval)
        itls = [x for s in await asyncio.gather(*streams) for x in s]
        codes = [r.status_code for r in await asyncio.gather(*pulls)]
    if any(c != 200 for c in codes):
        raise SystemExit(f"P/D requests failed: {codes}")
    return {"itl": itls, "pulls": len(codes)}


def metric_sum(url: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in httpx.get(f"{url}/metrics", timeout=5).text.splitlines()
               if line.startswith(name + "{"))


def run_interference(args: argparse.Namespace, tmp: Path, model_dir: str) -> int:
    prefill, prefill_url = start_worker(tmp, "prefill", model_dir)
    decode, decode_url = start_worker(tmp, "decode", model_dir)
    try:
        base: list[float] = []
        loaded: list[float] = []
        asyncio.run(phase(decode_url, prefill_url, argparse.Namespace(**{**vars(args), "pulls": 1}), True, "warm"))
        for r in range(args.rounds):
            base += asyncio.run(phase(decode_url, prefill_url, args, False, f"r{r}a"))["itl"]
            before = metric_sum(decode_url, "disagg:kv_bytes_loaded_total")
            loaded += asyncio.run(phase(decode_url, prefill_url, args, True, f"r{r}b"))["itl"]
            moved = metric_sum(decode_url, "disagg:kv_bytes_loaded_total") - before
            print(f"round {r}: {args.pulls} pulls moved {moved / 2**20:.1f} MiB", flush=True)
        xfer = metric_sum(decode_url, "vllm:nixl_xfer_time_seconds_sum") / max(
            1.0, metric_sum(decode_url, "vllm:nixl_xfer_time_seconds_count"))
        post = metric_sum(decode_url, "vllm:nixl_post_time_seconds_sum") / max(
            1.0, metric_sum(decode_url, "vllm:nixl_post_time_seconds_count"))
    finally:
        for proc in (decode, prefill):
            proc.terminate()
            proc.wait(60)
    p50a, p99a, p50b, p99b = (percentile(base, 0.5), percentile(base, 0.99), percentile(loaded, 0.5),
                              percentile(loaded, 0.99))
    for name, v in (("without pulls", base), ("with pulls:  ", loaded)):
        print(f"decode ITL {name}: p50 {percentile(v, 0.5) * 1e3:.1f} ms  p99 {percentile(v, 0.99) * 1e3:.1f} ms  "
              f"p99.9 {percentile(v, 0.999) * 1e3:.1f} ms  max {max(v) * 1e3:.1f} ms  (n={len(v)})")
    print(f"ratio with/without: p50 {p50b / p50a:.2f}x  p99 {p99b / p99a:.2f}x  (target p99 <= 1.2x); "
          f"mean READ post {post * 1e3:.2f} ms, post->done {xfer * 1e3:.2f} ms; mean ITL "
          f"{statistics.mean(base) * 1e3:.1f} / {statistics.mean(loaded) * 1e3:.1f} ms")
    return 0
