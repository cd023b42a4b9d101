"""P/D serving vs one colocated worker on the same machine, at fixed request rates, per engine.

For each engine (--engine disagg vllm: both, side by side) and each deployment - `disagg up` (router + 1 prefill +
1 decode, NIXL by default) and one colocated worker (`disagg worker --role both`, or `vllm serve` without a KV
connector) - sends streaming completions with Poisson arrivals at each rate and measures, client-side, time to
first token (TTFT) and inter-token latency (ITL), p50/p90. For P/D it also reads the decode worker's
vllm:nixl_xfer_time_seconds to give the KV transfer's share of TTFT. Prints P/D / colocated ratios. Both engines
serve the same generated checkpoint (head size 64, which vLLM's CPU attention needs) and the same prompts.

    python bench/pd_serving.py [--rates 2 4] [--num-requests 24] [--connector NixlConnector]
    DISAGG_VLLM=.venv-vllm/bin/vllm python bench/pd_serving.py --engine disagg vllm
    python bench/pd_serving.py --plot pd.png   # also TTFT and ITL CDFs, P/D vs colocated (needs matplotlib)
    python bench/pd_serving.py --signing off on --pd-rounds 3   # P/D with hand-off signing on vs off, one run

The deployments run one after the other so they never share the CPU. Not a test.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml

REPO = Path(__file__).resolve().parents[1]
from disagg.worker.local.process import free_port, is_ready
from disagg.worker.router import metrics as router_metrics
from plots import plot_latency_cdfs
import pd_interference  # the KV-pull interference case (--interference)

CLI = [sys.executable, "-m", "disagg.worker.cli"]
WORDS = "the history of the city begins with a small harbour and a market where fishermen sold fish".split()


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(int(q * len(values)), len(values) - 1)]


def metric_sum(url: str, name: str) -> float:
    total = 0.0
    for line in httpx.get(f"{url}/metrics", timeout=60).text.splitlines():  # vLLM answers late when busy
        if line.startswith(name + "{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def one_request(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int) -> tuple[float, list[float]]:
    body = {"model": "tiny-llama", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    start = time.perf_counter()
    times: list[float] = []
    async with client.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread()).decode()[:300]}")
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(chunk["error"]["message"])
                if chunk["choices"] and chunk["choices"][0]["text"]:
                    times.append(time.perf_counter())
    ttft = times[0] - start
    return ttft, [b - a for a, b in zip(times, times[1:])]


async def run_load(url: str, rate: float, n: int, prompt_words: int, max_tokens: int, seed: int) -> dict:
    rng = random.Random(seed)
    prompts = [" ".join(rng.choice(WORDS) for _ in range(prompt_words)) + f" {i}" for i in range(n)]
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=256)) as client:
        tasks = []
        for prompt in prompts:
            tasks.append(asyncio.ensure_future(one_request(client, url, prompt, max_tokens)))
            await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
    return latency_summary([t for t, _ in results], [x for _, gaps in results for x in gaps])


def latency_summary(ttfts: list[float], itls: list[float]) -> dict:
    return {"ttft_p50": percentile(ttfts, 0.5), "ttft_p90": percentile(ttfts, 0.9), "ttft_mean": statistics.mean(ttfts),
            "itl_p50": percentile(itls, 0.5), "itl_p90": percentile(itls, 0.9), "ttfts": ttfts, "itls": itls}


def pooled(runs: list[dict[float, dict]]) -> dict[float, dict]:
    """Several runs of one setup as one: their requests' latencies together (the transfer share: the mean)."""
    out = {}
    for rate in runs[0]:
        r = latency_summary([t for run in runs for t in run[rate]["ttfts"]],
                            [x for run in runs for x in run[rate]["itls"]])
        if "xfer_mean" in runs[0][rate]:
            r["xfer_mean"] = statistics.mean(run[rate]["xfer_mean"] for run in runs)
        if "stages" in runs[0][rate]:
            r["stages"] = runs[0][rate]["stages"]
        out[rate] = r
    return out


def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while not is_ready(url):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"{url} did not become ready")
        time.sleep(0.2)


# a colocated vLLM binds its OpenMP threads to every core (its best setting alone); under `disagg up` each vLLM
# process gets cores of its own from the launcher (launcher.vllm_cpu_bind)
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "2"}
VLLM_ALONE_ENV = {**VLLM_ENV, "VLLM_CPU_OMP_THREADS_BIND": f"0-{(os.cpu_count() or 1) - 1}"}
STARTUP_S = {"disagg": 180, "vllm": 600}
# where P/D's first streamed token comes from -> the router's flags for it
FIRST_TOKEN = {"prefill": [], "decode": ["--no-early-first-token"]}


def start_pd(tmp: Path, connector: str, engine: str, model_dir: str, worker_args: list[str],
             router_args: list[str] = (), up_args: list[str] = ()) -> tuple[subprocess.Popen, str, str]:
    doc = yaml.safe_load((REPO / "examples" / "local.yaml").read_text())
    spec = doc["spec"]
    spec.setdefault("router", {})["extraArgs"] = list(router_args)
    spec["kvTransfer"]["connector"] = connector
    spec["decode"]["replicas"] = 1
    spec["model"]["source"] = {"path": model_dir}
    spec["engine"] = engine
    if engine == "vllm":
        for role in ("prefill", "decode"):
            spec[role]["env"] = [{"name": k, "value": v} for k, v in VLLM_ENV.items()]
    (tmp / f"spec-{engine}.yaml").write_text(yaml.safe_dump(doc))
    port = free_port()
    out = tmp / f"up-{engine}.out"
    extra = [f"--worker-arg={a}" for a in worker_args] if engine == "disagg" else []
    proc = subprocess.Popen([*CLI, "up", "-f", str(tmp / f"spec-{engine}.yaml"), "--port", str(port), "--log-dir",
                             str(tmp / f"logs-{engine}"), "--startup-timeout", str(STARTUP_S[engine]), *extra,
                             *up_args],
                            stdout=out.open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + STARTUP_S[engine] + 30
    while "serving" not in out.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"disagg up failed:\n{out.read_text()}")
        time.sleep(0.2)
    workers = dict(re.findall(r"(\S+)\s+ready\s+(http://\S+)", out.read_text()))
    STAGE_URLS[url] = {"router": url, "prefill": workers["prefill-0"], "decode": workers["decode-0"]}
    return proc, url, workers["decode-0"]


def start_colocated(tmp: Path, engine: str, model_dir: str, worker_args: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    common = ["--served-model-name", "tiny-llama", "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
              "--max-model-len", "512"]
    if engine == "vllm":
        argv, env = [vllm_executable(), "serve", model_dir, *common], {**os.environ, **VLLM_ALONE_ENV}
    else:
        argv, env = [*CLI, "worker", "--role", "both", "--model", model_dir, *common, *worker_args], None
    proc = subprocess.Popen(argv, stdout=(tmp / f"colocated-{engine}.log").open("w"), stderr=subprocess.STDOUT,
                            env=env)
    url = f"http://127.0.0.1:{port}"
    wait_ready(url, proc, STARTUP_S[engine])
    return proc, url


def vllm_executable() -> str:
    from disagg.worker.local.launcher import find_vllm

    try:
        return find_vllm()
    except ValueError as e:
        raise SystemExit(str(e))


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(90)
    except subprocess.TimeoutExpired:
        proc.kill()


# --breakdown: where P/D's TTFT goes, from the router's and the workers' own histograms (means per request)
STAGE_URLS: dict[str, dict[str, str]] = {}  # router url -> component -> url (filled by start_pd)
STAGE_HISTOGRAMS = {
    ("router", router_metrics.TTFT, ""): "router_ttft",
    ("router", router_metrics.HOP_LATENCY, 'hop="prefill"'): "prefill_hop",
    ("prefill", "vllm:e2e_request_latency_seconds", ""): "prefill_e2e",
    ("decode", "vllm:time_to_first_token_seconds", ""): "decode_ttft",
    ("decode", "vllm:nixl_xfer_time_seconds", ""): "xfer",
}


def histogram_totals(urls: dict[str, str]) -> dict[str, tuple[float, float]]:
    """stage -> (sum, count) of its histogram now."""
    texts = {c: httpx.get(f"{u}/metrics", timeout=60).text for c, u in urls.items()}  # vLLM answers late when busy
    out = {}
    for (component, name, label), stage in STAGE_HISTOGRAMS.items():
        total = {"_sum": 0.0, "_count": 0.0}
        for line in texts[component].splitlines():
            for suffix in total:
                if line.startswith(name + suffix + "{") and label in line:
                    total[suffix] += float(line.rsplit(" ", 1)[1])
        out[stage] = (total["_sum"], total["_count"])
    return out


def stage_breakdown(before: dict, after: dict, client_ttft_mean: float, early: bool) -> dict[str, float]:
    """Mean seconds per request of each stage of a P/D request's TTFT, from two histogram snapshots.
    prefill compute: the prefill worker's arrival to finish (queue + forward); prefill HTTP: the rest of the
    router's prefill hop; router: its arrival to its first byte out (router_ttft) minus the prefill hop - with
    the early first token the router's own work, else mostly the decode hop, split into transfer (the decode
    worker's NIXL READ), decode admission (the decode worker's arrival to first token minus the READ: queue,
    scheduler wake-ups, the first step) and decode HTTP (the rest: parsing, tokenizing, streaming back);
    client: the client's TTFT minus the router's (the last hop, the client's own parsing). With the early
    first token the decode hop's stages come after the first token: listed apart, they are not in TTFT."""
    mean = {k: (after[k][0] - before[k][0]) / max(after[k][1] - before[k][1], 1) for k in after}
    out = {"prefill HTTP": mean["prefill_hop"] - mean["prefill_e2e"], "prefill compute": mean["prefill_e2e"]}
    decode = {"transfer": mean["xfer"], "decode admission": mean["decode_ttft"] - mean["xfer"]}
    if early:
        out["router"] = mean["router_ttft"] - mean["prefill_hop"]
    else:
        out.update(decode)
        out["decode HTTP"] = mean["router_ttft"] - mean["prefill_hop"] - mean["decode_ttft"]
    out["client"] = client_ttft_mean - mean["router_ttft"]
    if early:
        out.update({f"after the first token: {k}": v for k, v in decode.items()})
    return out


def measure(url: str, args: argparse.Namespace, decode: str | None, early: bool = True) -> dict[float, dict]:
    asyncio.run(run_load(url, 4, 4, args.prompt_words, 4, seed=99))  # warm-up
    out = {}
    for rate in args.rates:
        before = (metric_sum(decode, "vllm:nixl_xfer_time_seconds_sum"),
                  metric_sum(decode, "vllm:nixl_xfer_time_seconds_count")) if decode else (0, 0)
        stages = STAGE_URLS.get(url) if args.breakdown else None
        snap = histogram_totals(stages) if stages else None
        out[rate] = asyncio.run(run_load(url, rate, args.num_requests, args.prompt_words, args.max_tokens, seed=1))
        if stages:
            out[rate]["stages"] = stage_breakdown(snap, histogram_totals(stages), out[rate]["ttft_mean"], early)
        if decode:
            xfer_sum = metric_sum(decode, "vllm:nixl_xfer_time_seconds_sum") - before[0]
            xfer_n = metric_sum(decode, "vllm:nixl_xfer_time_seconds_count") - before[1]
            out[rate]["xfer_mean"] = xfer_sum / xfer_n if xfer_n else float("nan")
    return out


# hand-off signing (issue 28) -> `disagg up`'s flags for it
SIGNING = {"on": [], "off": ["--no-handoff-signing"]}


def pd_name(mode: str, signing: str, args: argparse.Namespace) -> str:
    """A P/D run's row name: its first-token mode, and its signing when both are measured."""
    return mode if len(args.signing) == 1 else f"{mode} sig {signing}"


def signing_cost_us(n: int = 2000) -> float:
    """Microseconds one hand-off costs to sign at the prefill worker and check at the decode worker (the HTTP
    layer's work for it: parse, HMAC, replay cache), measured in this process."""
    import base64
    import os as os_

    from disagg.worker.kv_transfer.handoff import Handoff
    from disagg.worker.kv_transfer.handoff_auth import HandoffSigner

    key = os_.urandom(32)
    prefill, decode = HandoffSigner(key, "bench/pd"), HandoffSigner(key, "bench/pd")
    wire = {"do_remote_prefill": True, "remote_engine_id": base64.b16encode(os_.urandom(8)).decode(),
            "remote_block_ids": list(range(20)), "remote_host": "10.0.0.7", "remote_port": 5600,
            "remote_lease_expires_at": time.time() + 30, "tp_size": 1}
    start = time.perf_counter()
    for i in range(n):
        signed = prefill.sign_params({**wire, "remote_request_id": f"req-{i}"})
        decode.verify(Handoff.parse(signed))
    return (time.perf_counter() - start) / n * 1e6


def report_signing(args: argparse.Namespace, results: dict[str, tuple[dict, dict]]) -> None:
    if len(args.signing) < 2:
        return
    cost = signing_cost_us()
    print(f"\nhand-off signing: sign + check one hand-off costs {cost:.1f} us (this machine, in-process)")
    for engine, (_colo, pds) in results.items():
        for mode in args.first_token:
            on, off = pds[pd_name(mode, "on", args)], pds[pd_name(mode, "off", args)]
            for rate in args.rates:
                ratio = on[rate]["ttft_p50"] / off[rate]["ttft_p50"]
                print(f"{engine:>7} {rate:7.1f} first token from {mode}: TTFT p50 signing on "
                      f"{on[rate]['ttft_p50'] * 1000:.1f} ms, off {off[rate]['ttft_p50'] * 1000:.1f} ms: "
                      f"{ratio:.3f}x ({(ratio - 1) * 100:+.1f}%); "
                      f"the signing itself is {cost / 1e4 / off[rate]['ttft_p50']:.3f}% of that TTFT")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rates", type=float, nargs="+", default=[2.0, 4.0], help="requests per second")
    p.add_argument("--num-requests", type=int, default=24, help="per rate")
    p.add_argument("--prompt-words", type=int, default=150, help="~2.4 tokens per word with the tiny tokenizer")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--connector", default="NixlConnector")
    p.add_argument("--engine", nargs="+", choices=["disagg", "vllm"], default=["disagg"],
                   help="engines to measure, one after the other (vllm: $DISAGG_VLLM or `vllm` on PATH)")
    p.add_argument("--breakdown", action="store_true",
                   help="P/D (disagg engine): mean TTFT per stage, from the router's and workers' /metrics")
    p.add_argument("--plot", metavar="PNG", help="draw TTFT and ITL CDFs, P/D vs colocated (needs matplotlib)")
    p.add_argument("--signing", nargs="+", choices=list(SIGNING), default=["on"],
                   help="P/D with the hand-off key `disagg up` gives its workers (on) or without (off: "
                        "--no-handoff-signing); both: one after the other, and their TTFT p50 ratio")
    p.add_argument("--pd-rounds", type=int, default=1, help="start and measure each P/D setup this many times, "
                   "alternating the --signing settings, and pool their requests (noise on a shared machine)")
    p.add_argument("--first-token", nargs="+", choices=list(FIRST_TOKEN), default=list(FIRST_TOKEN),
                   help="P/D's first token: from the prefill's answer (the router's default), from the decode "
                        "worker (router --no-early-first-token), or both, one after the other")
    pd_interference.add_arguments(p)
    args = p.parse_args()
    if "vllm" in args.engine:
        vllm_executable()  # fail before measuring anything
    # one intra-op thread per process: on a small machine several torch processes with a thread per core
    # each spin against one another and the tails measure that, not serving (seen: 30x swings run to run)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    worker_args = ["--num-kv-blocks=1024"]
    results: dict[str, tuple[dict, dict]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-pd-") as d:
        tmp = Path(d)
        from disagg.worker.model import write_tiny_checkpoint

        model_dir = str(write_tiny_checkpoint(tmp / "model", hidden_size=256, num_heads=4, num_kv_heads=2,
                                              intermediate_size=512, num_layers=2))
        if args.interference:
            return pd_interference.run_interference(args, tmp, model_dir)
        for engine in args.engine:
            proc, url = start_colocated(tmp, engine, model_dir, worker_args)
            try:
                colo = measure(url, args, None)
            finally:
                stop(proc)
            pds = {}
            for mode in args.first_token:
                runs: dict[str, list] = {}
                for round_ in range(args.pd_rounds):  # signing settings alternate, so that drift hits both alike
                    for signing in (args.signing if round_ % 2 == 0 else args.signing[::-1]):
                        proc, url, decode = start_pd(tmp, args.connector, engine, model_dir, worker_args,
                                                     FIRST_TOKEN[mode], SIGNING[signing])
                        try:
                            runs.setdefault(pd_name(mode, signing, args), []).append(measure(
                                url, args, decode if args.connector == "NixlConnector" else None,
                                early=mode == "prefill"))
                        finally:
                            stop(proc)
                pds.update({name: pooled(r) for name, r in runs.items()})
            results[engine] = colo, pds
    report(args, results)
    report_signing(args, results)
    return 0


def report(args: argparse.Namespace, results: dict[str, tuple[dict, dict]]) -> None:
    ms = lambda s: f"{s * 1000:8.1f}"  # noqa: E731
    print(f"\nP/D ({args.connector}, router + 1 prefill + 1 decode) vs 1 colocated worker, per engine; "
          f"{args.num_requests} streaming requests per rate, ~{args.prompt_words}-word prompts, "
          f"{args.max_tokens} tokens out; times in ms")
    print(f"{'engine':>7} {'rate/s':>7} {'setup':>12} {'TTFT p50':>9} {'TTFT p90':>9} {'ITL p50':>9} {'ITL p90':>9} "
          f"{'KV xfer':>9}")
    print("  P/D first token from: prefill = the prefill's answer, streamed by the router (its default); "
          "decode = the decode worker, after the KV transfer (router --no-early-first-token)")
    for engine, (colo, pds) in results.items():
        for rate in args.rates:
            c = colo[rate]
            rows = [("colocated", c)] + [(f"P/D {mode}", pd[rate]) for mode, pd in pds.items()]
            for name, r in rows:
                xfer = (f"{ms(r['xfer_mean'])} ({r['xfer_mean'] / r['ttft_mean']:.1%} of TTFT)"
                        if "xfer_mean" in r else "")
                print(f"{engine:>7} {rate:7.1f} {name:>12} {ms(r['ttft_p50'])} {ms(r['ttft_p90'])} "
                      f"{ms(r['itl_p50'])} {ms(r['itl_p90'])} {xfer}")
            for mode, pd in pds.items():
                q = pd[rate]
                if "stages" in q:
                    print(f"{'':>7} {'':>7} {'stages ' + mode:>12} mean TTFT {ms(q['ttft_mean'])} (colocated "
                          f"{ms(c['ttft_mean'])}): " + ", ".join(f"{k} {v * 1000:.1f}" for k, v in q["stages"].items()))
                print(f"{engine:>7} {rate:7.1f} {mode + '÷colo':>12} {q['ttft_p50'] / c['ttft_p50']:8.2f}x "
                      f"{q['ttft_p90'] / c['ttft_p90']:8.2f}x {q['itl_p50'] / c['itl_p50']:8.2f}x "
                      f"{q['itl_p90'] / c['itl_p90']:8.2f}x")
    if args.plot:
        runs = {f"{engine} {name}": r for engine, (colo, pds) in results.items()
                for name, r in [("colocated", colo)] + [(f"P/D {m} ({args.connector})", pd) for m, pd in pds.items()]}
        plot_latency_cdfs(args.plot, runs, f"P/D (router + 1 prefill + 1 decode) vs 1 colocated worker per engine: "
                          f"{args.num_requests} streaming requests per rate, ~{args.prompt_words}-word prompts, "
                          f"{args.max_tokens} tokens out")
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    sys.exit(main())
