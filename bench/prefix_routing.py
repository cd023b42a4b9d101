"""Cache-aware P/D routing: router.policy prefix-aware vs round-robin vs least-loaded on a multi-tenant
shared-prefix workload, against `disagg up` with 2 prefill + 2 decode workers.

Each of --tenants tenants has a long system prompt; each request is one tenant's system prompt plus a short user
turn, tenants drawn uniformly, Poisson arrivals at each --rates. The workers' KV cache (--num-kv-blocks) holds every
tenant's prefix across a pool of two but not in one worker, so where a request lands decides whether its prefix
is reused. Per policy and rate, client-side: TTFT p50/p90 and output tokens/s; from the workers' metrics: prefix
hit rate (prompt tokens not computed: local prefix-cache hits, KV pulled from a prefill worker aside) and KV bytes
moved from prefill to decode. The oracle hit rate is what a router that knows every worker's cache could get: the
first request of a tenant computes its prefix, every later one reuses all of its full blocks. Prints the ratios
prefix-aware / round-robin at the highest rate where round-robin's p90 TTFT is under 2 s.

    python bench/prefix_routing.py [--rates 4 8 16] [--num-requests 48] [--tenants 8] [--gateway]

With --gateway the clients go through a real Envoy whose ext_proc is our endpoint picker (`disagg up --gateway`):
the same policies, picked by the gateway instead of proxied by the router.

The policies run one after the other (a fresh `disagg up` each, so no cache carries over). Not a test.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pd_serving import metric_sum, one_request, percentile, stop  # noqa: E402

from disagg.worker.engine.block_pool import hash_request_blocks  # noqa: E402
from disagg.worker.local.process import free_port  # noqa: E402
from disagg.worker.model.tokenizer import Tokenizer  # noqa: E402
from disagg.worker.router.prefix_policy import PrefixPolicyConfig  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "disagg.worker.cli"]
POLICIES = ("prefix-aware", "round-robin", "least-loaded")
BLOCK_SIZE = 16
WORDS = ("harbour market fishermen morning catch merchants hills salt wool passes snow winter river bridge "
         "tower bell square church mill baker smith road cart horse lantern").split()


def tenant_prompts(n_tenants: int, words: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [f"System prompt of tenant {t}: " + " ".join(rng.choice(WORDS) for _ in range(words))
            for t in range(n_tenants)]


def workload(systems: list[str], n: int, seed: int) -> list[tuple[int, str]]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        t = rng.randrange(len(systems))
        out.append((t, f"{systems[t]}\nUser {i}: " + " ".join(rng.choice(WORDS) for _ in range(12))))
    return out


def oracle_hit_rate(tok: Tokenizer, requests: list[tuple[int, str]], seen: set[bytes]) -> float:
    """Reuse of full blocks an earlier request (of this rate or an earlier one: `seen`, updated) computed
    anywhere, the pool holding every prefix."""
    hit = total = 0
    for _, prompt in requests:
        ids = tok.encode(prompt)
        hashes = hash_request_blocks(ids[: (len(ids) - 1) // BLOCK_SIZE * BLOCK_SIZE], BLOCK_SIZE, [])
        n = 0
        while n < len(hashes) and hashes[n] in seen:
            n += 1
        hit += n * BLOCK_SIZE
        total += len(ids)
        seen.update(hashes)
    return hit / total if total else 0.0


async def run_load(url: str, rate: float, requests: list[tuple[int, str]], max_tokens: int, seed: int) -> dict:
    rng = random.Random(seed)
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=256)) as client:
        tasks = []
        start = time.perf_counter()
        for _, prompt in requests:
            tasks.append(asyncio.ensure_future(one_request(client, url, prompt, max_tokens)))
            await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        wall = time.perf_counter() - start
    ttfts = [r[0] for r in results]
    return {"ttft_p50": percentile(ttfts, 0.5), "ttft_p90": percentile(ttfts, 0.9),
            "tok_s": len(requests) * max_tokens / wall}


def start_up(tmp: Path, policy: str, model_dir: str, connector: str, worker_args: list[str],
             router_args: list[str], gateway: bool = False) -> tuple:
    doc = yaml.safe_load((REPO / "examples" / "local.yaml").read_text())
    spec = doc["spec"]
    spec["model"]["source"] = {"path": model_dir}
    spec["model"]["maxModelLen"] = 1024
    spec["kvTransfer"]["connector"] = connector
    spec["prefill"]["replicas"] = spec["decode"]["replicas"] = 2
    spec["router"]["policy"] = policy
    if policy == "prefix-aware":  # the router's flags; behind the gateway the endpoint picker takes them
        if gateway:
            spec.setdefault("gateway", {})["endpointPicker"] = {"extraArgs": router_args}
        else:
            spec["router"]["extraArgs"] = router_args
    (tmp / f"spec-{policy}.yaml").write_text(yaml.safe_dump(doc))
    port, out = free_port(), tmp / f"up-{policy}.out"
    proc = subprocess.Popen([*CLI, "up", "-f", str(tmp / f"spec-{policy}.yaml"), "--port", str(port), "--log-dir",
                             str(tmp / f"logs-{policy}"), "--startup-timeout", "300",
                             *(["--gateway"] if gateway else []), *[f"--worker-arg={a}" for a in worker_args]],
                            stdout=out.open("w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 330
    while "  -> " not in out.read_text():  # its first request answered
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"disagg up failed:\n{out.read_text()}")
        time.sleep(0.5)
    workers = dict(re.findall(r"((?:prefill|decode)-\d+)\s+ready\s+(http://\S+)", out.read_text()))
    return proc, f"http://127.0.0.1:{port}", workers


def worker_totals(workers: dict[str, str]) -> dict[str, float]:
    t = {"queries": 0.0, "hits": 0.0, "kv_bytes": 0.0}
    for url in workers.values():
        t["queries"] += metric_sum(url, "vllm:prefix_cache_queries_total")
        t["hits"] += metric_sum(url, "vllm:prefix_cache_hits_total")
        t["kv_bytes"] += metric_sum(url, "disagg:kv_bytes_loaded_total")
    return t


def measure_policy(tmp: Path, policy: str, args: argparse.Namespace, model_dir: str, bytes_per_token: int,
                   tok: Tokenizer, systems: list[str]) -> dict[float, dict]:
    proc, url, workers = start_up(tmp, policy, model_dir, args.connector, args.worker_args,
                                  ["--prefix-skip-prefill-blocks", str(args.skip_prefill_blocks),
                                   "--prefix-load-cost-tokens", str(args.load_cost_tokens)], args.gateway)
    out = {}
    try:
        if policy == "prefix-aware":  # the router learns the tokenizer and subscribes within a probe interval
            time.sleep(3)
        asyncio.run(run_load(url, 4, workload(["warm-up"], 4, 99), 4, 99))
        for i, rate in enumerate(args.rates):
            requests = workload(systems, args.num_requests, seed=1 + i)
            before = worker_totals(workers)
            res = asyncio.run(run_load(url, rate, requests, args.max_tokens, seed=1 + i))
            after = worker_totals(workers)
            d = {k: after[k] - before[k] for k in after}
            prompt = sum(len(tok.encode(p)) for _, p in requests)
            # every prompt token is looked up where it is computed; decode's lookups after a prefill hop find
            # (hits) or pull (KV bytes) the rest, so what was computed = misses - pulled
            computed = max(d["queries"] - d["hits"] - d["kv_bytes"] / bytes_per_token, 0.0)
            res.update(hit_rate=1 - min(computed / prompt, 1.0), kv_mb=d["kv_bytes"] / 1e6)
            out[rate] = res
            print(f"  {policy:13s} rate {rate:5.1f}/s  TTFT p50 {res['ttft_p50']:.3f}s p90 {res['ttft_p90']:.3f}s  "
                  f"{res['tok_s']:6.1f} tok/s  hit rate {res['hit_rate']:.2f}  KV {res['kv_mb']:.1f} MB",
                  flush=True)
    finally:
        stop(proc)
    return out


def report(results: dict[str, dict[float, dict]], oracle: dict[float, float], rates: list[float]) -> None:
    print("\npolicy          rate   TTFT p50   TTFT p90   tok/s   hit rate   oracle   KV MB")
    for policy, per_rate in results.items():
        for rate, r in per_rate.items():
            print(f"{policy:13s} {rate:6.1f} {r['ttft_p50']:9.3f}s {r['ttft_p90']:9.3f}s {r['tok_s']:7.1f} "
                  f"{r['hit_rate']:9.2f} {oracle[rate]:8.2f} {r['kv_mb']:8.1f}")
    print("oracle: the hit rate of a router that knows every worker's cache (the pool holds every prefix; "
          "rates run in order on one deployment, so later rates start warm)")
    rr, pa = results.get("round-robin", {}), results.get("prefix-aware", {})
    ok = [r for r in rates if r in rr and rr[r]["ttft_p90"] < 2.0]
    if not ok or not pa:
        print("round-robin misses p90 TTFT < 2 s at every rate: no ratio (lower --rates)")
        return
    r = max(ok)
    print(f"\nat {r}/s (highest rate where round-robin's p90 TTFT < 2 s):")
    for base in ("round-robin", "least-loaded"):
        if base in results and r in results[base]:
            b, p = results[base][r], pa[r]
            print(f"  {base:12s} / prefix-aware: TTFT p90 {b['ttft_p90'] / p['ttft_p90']:.2f}x, "
                  f"p50 {b['ttft_p50'] / p['ttft_p50']:.2f}x; tok/s prefix-aware / {base} "
                  f"{p['tok_s'] / b['tok_s']:.2f}x; KV bytes {p['kv_mb'] / max(b['kv_mb'], 1e-9):.2f}x")
    print(f"  prefix-aware hit rate {pa[r]['hit_rate']:.2f} vs oracle {oracle[r]:.2f} "
          f"({pa[r]['hit_rate'] / oracle[r]:.0%} of it)")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rates", type=float, nargs="+", default=[4.0, 8.0, 16.0])
    p.add_argument("--num-requests", type=int, default=48, help="per rate")
    p.add_argument("--tenants", type=int, default=8)
    p.add_argument("--system-words", type=int, default=150, help="system prompt length (~3.3 tokens per word)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--num-kv-blocks", type=int, default=0, help="per worker (default: ~0.6 of all prefixes)")
    p.add_argument("--connector", default="NixlConnector")
    p.add_argument("--skip-prefill-blocks", type=int, default=PrefixPolicyConfig.skip_prefill_max_missing_blocks,
                   help="prefix-aware's --prefix-skip-prefill-blocks")
    p.add_argument("--load-cost-tokens", type=float, default=PrefixPolicyConfig.load_cost_tokens,
                   help="prefix-aware's --prefix-load-cost-tokens")
    p.add_argument("--hidden-size", type=int, default=384, help="of the generated model: prefill must cost "
                   "something next to the HTTP hops for a prefix hit to show in TTFT")
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES))
    p.add_argument("--gateway", action="store_true", help="clients go through `disagg up --gateway` (Envoy + our "
                   "endpoint picker, which routes by the same policy) instead of the router")
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # 5 processes on a small machine (see pd_serving.py)
    with tempfile.TemporaryDirectory(prefix="bench-prefix-") as d:
        tmp = Path(d)
        from disagg.worker.model import write_tiny_checkpoint

        layers, kv_heads, heads = args.layers, 2, 4
        model_dir = str(write_tiny_checkpoint(tmp / "model", hidden_size=args.hidden_size, num_heads=heads,
                                              num_kv_heads=kv_heads, intermediate_size=4 * args.hidden_size,
                                              num_layers=layers))
        head_dim = args.hidden_size // heads
        tok = Tokenizer(model_dir)
        systems = tenant_prompts(args.tenants, args.system_words, seed=7)
        prefix_blocks = sum(len(tok.encode(s)) // BLOCK_SIZE for s in systems)
        blocks = args.num_kv_blocks or max(int(prefix_blocks * 0.6), 1024 // BLOCK_SIZE + 8)
        print(f"{args.tenants} tenants, prefixes {prefix_blocks} blocks in all; {blocks} KV blocks per worker; "
              f"model hidden {args.hidden_size} x {layers} layers; connector {args.connector}; "
              f"front door {'Envoy + endpoint picker' if args.gateway else 'router'}; "
              f"the machine is shared, so absolute figures are noisy", flush=True)
        args.worker_args = [f"--num-kv-blocks={blocks}"]
        bytes_per_token = 2 * layers * kv_heads * head_dim * 4  # K and V, float32
        seen: set[bytes] = set()
        oracle = {rate: oracle_hit_rate(tok, workload(systems, args.num_requests, seed=1 + i), seen)
                  for i, rate in enumerate(args.rates)}
        results = {pol: measure_policy(tmp, pol, args, model_dir, bytes_per_token, tok, systems)
                   for pol in args.policies}
    report(results, oracle, args.rates)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
