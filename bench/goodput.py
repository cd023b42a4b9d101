"""Goodput under latency SLOs at equal cores: P/D against colocated workers, per workload and engine (issue 32).

Configurations (default, 2 cores): 1 prefill + 1 decode worker (one core each), 2 colocated workers behind the
router (one core each, least-loaded), 1 colocated worker on both cores. Every worker is pinned (taskset; torch /
OpenMP threads = its cores; VLLM_CPU_OMP_THREADS_BIND for vLLM) and started from `disagg up`'s plan; the router and
this load generator are not pinned. Workloads are generated token-id prompts (goodput_load.WORKLOADS):
long-prompt (1000-3000 tokens in, 64-256 out), chat (100-800 / 100-400) and shared-prefix (one of 4 shared
1024-token documents + 50-300 tokens / 64-256).

Per round, each configuration in turn (the order rotates per round, so drift hits every one alike): start it,
warm it up, and per workload send unloaded requests one at a time, then Poisson arrivals at rising rates
(--seconds-per-rate each), stopping above the first rate where fewer than --stop-below of the requests meet the
SLOs known so far. SLOs per workload: TTFT <= --ttft-x and TPOT <= --tpot-x times the medians of ALL unloaded
samples of that workload (every configuration, every round) - one threshold per workload for every
configuration. Goodput: the highest rate at which it and every lower rate keep >= --target of requests inside
both SLOs. Prints attainment per rate (mean over rounds, with min-max), goodput per round, TTFT/TPOT
p50/p90/p99, P/D's mean TTFT by stage (router and workers' /metrics), and writes everything to --json.

    python bench/goodput.py                               # disagg engine, 3 workloads, 2 rounds: ~15-20 min
    DISAGG_VLLM=/path/to/vllm python bench/goodput.py --engine vllm   # vLLM: ~25 min (each start ~1 min)
    python bench/goodput.py --quick                       # smoke run: 1 round, 3 rates, short windows: ~6 min
    python bench/goodput.py --plot goodput.png --save-capacity cap.json   # + attainment curves, + a capacity
    python bench/autoscale_sim.py --capacity cap-disagg.json --peak-pods 32   # ... model for the autoscaler replay

The model is a generated random-weight Llama (hidden 256, 2 layers, 4 heads, max length 4096: bigger than
`disagg up`'s tiny default, whose 2k-token prefill is too cheap next to a decode step to show any interference).
Not a test.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import goodput_load as load
from goodput_deploy import MODEL_NAME, Config, Deployment, parse_config
from goodput_report import attained, fit_capacity, slo_for, summarise, table

MAX_MODEL_LEN = 4096
STARTUP_S = {"disagg": 180, "vllm": 600}
# default rates per workload (req/s), climbing until attainment collapses; --rates overrides for every workload
RATES = {"long-prompt": [1, 2, 3, 4, 5, 6, 8], "chat": [1, 2, 3, 4, 6, 8, 10], "shared-prefix": [1, 2, 3, 4, 6, 8, 10]}
QUICK_RATES = {"long-prompt": [1, 2, 4], "chat": [1, 3, 6], "shared-prefix": [1, 3, 6]}


def stage_urls(dep: Deployment) -> dict[str, str] | None:
    """P/D with one worker per role: where pd_serving's stage breakdown reads its histograms."""
    p, d = dep.urls("prefill"), dep.urls("decode")
    return {"router": dep.url, "prefill": p[0], "decode": d[0]} if len(p) == 1 and len(d) == 1 else None


def cpu_per_request(dep: Deployment, before: dict[str, float], n: int) -> dict[str, float]:
    """CPU seconds per request by role (colocated workers count as decode) since `before`, and their total."""
    after = dep.cpu_seconds()
    out: dict[str, float] = {}
    for w in dep.workers:
        out[w.spec.role] = out.get(w.spec.role, 0.0) + (after[w.spec.name] - before[w.spec.name]) / max(n, 1)
    out["total"] = sum(out.values())
    return out


def cpu_line(cpu: dict[str, float]) -> str:
    return "worker CPU ms per request: " + ", ".join(f"{k} {v * 1000:.0f}" for k, v in cpu.items())


def measure_config(dep: Deployment, args: argparse.Namespace, round_: int, runs: dict, all_unloaded: dict,
                   stages: dict, cpu: dict, say) -> None:
    from pd_serving import histogram_totals, stage_breakdown

    urls = stage_urls(dep)
    for name in args.workloads:
        w = load.WORKLOADS[name]
        warm = load.warmup_requests(w, copies=max(dep.config.prefill, dep.config.decode))
        for i in range(0, len(warm), max(dep.config.prefill, dep.config.decode)):  # one document at a time
            load.poisson(dep.url, MODEL_NAME, warm[i:i + max(dep.config.prefill, dep.config.decode)], 1000, 0)
        cpu0 = dep.cpu_seconds()
        un = load.unloaded(dep.url, MODEL_NAME, load.requests_for(w, args.unloaded, seed=100 + round_))
        cpu.setdefault(dep.config.name, {}).setdefault(name, {}).setdefault("unloaded", []).append(
            cpu_per_request(dep, cpu0, len(un)))
        run = runs.setdefault(dep.config.name, {}).setdefault(name, {"unloaded": [], "rates": {}})
        run["unloaded"].append(un)
        all_unloaded.setdefault(name, []).extend(un)
        slo = slo_for(all_unloaded[name], args.ttft_x, args.tpot_x)  # provisional: the samples so far
        say(f"  {name}: unloaded TTFT median {statistics.median(r.ttft for r in un if r.ok) * 1000:.1f} ms, TPOT "
            f"{statistics.median(r.tpot for r in un if r.ok) * 1000:.2f} ms ({sum(r.ok for r in un)}/{len(un)} ok); "
            + cpu_line(cpu[dep.config.name][name]["unloaded"][-1]))
        stopped = False
        for rate in args.rates or RATES[name]:
            slot = run["rates"].setdefault(rate, [])
            if stopped:
                slot.append(None)
                continue
            n = max(args.min_requests, round(rate * args.seconds_per_rate))
            reqs = load.requests_for(w, n, seed=1000 * round_ + int(rate * 10))
            before = histogram_totals(urls) if urls else None
            t0, cpu0 = time.monotonic(), dep.cpu_seconds()
            res = load.poisson(dep.url, MODEL_NAME, reqs, rate, seed=round_ * 7919 + int(rate * 10),
                               drain_s=args.drain_s)
            slot.append(res)
            used = cpu_per_request(dep, cpu0, n)
            cpu[dep.config.name][name].setdefault(rate, []).append(used)
            frac = attained(res, slo)
            line = (f"  {name} {rate:g} req/s: {frac:.0%} within SLOs (so far: TTFT <= {slo['ttft_s'] * 1000:.0f} "
                    f"ms, TPOT <= {slo['tpot_s'] * 1000:.2f} ms), {sum(r.ok for r in res)}/{n} ok, "
                    f"{time.monotonic() - t0:.0f} s; " + cpu_line(used))
            if urls:
                ok = [r.ttft for r in res if r.ok]
                st = stage_breakdown(before, histogram_totals(urls), statistics.mean(ok) if ok else 0.0, early=True)
                stages.setdefault(dep.config.name, {}).setdefault(name, {}).setdefault(rate, []).append(st)
                line += "\n    mean TTFT by stage (ms): " + ", ".join(f"{k} {v * 1000:.1f}" for k, v in st.items())
            say(line)
            stopped = frac < args.stop_below


def run_engine(engine: str, args: argparse.Namespace, configs: list[Config], model_dir: str, tmp: Path,
               say) -> dict:
    runs: dict = {}
    all_unloaded: dict = {}
    stages: dict = {}
    cpu: dict = {}  # config -> workload -> "unloaded" or rate -> [{role: CPU s per request} per round]
    startup: dict[str, list[float]] = {}
    worker_args = [f"--max-num-batched-tokens={args.max_num_batched_tokens}"] if args.max_num_batched_tokens else []
    for round_ in range(args.rounds):
        order = configs[round_ % len(configs):] + configs[:round_ % len(configs)]
        for config in order:
            say(f"[{engine}] round {round_ + 1}/{args.rounds}: {config.name} ({config.cores} cores)  "
                f"load: {os.getloadavg()[0]:.2f}")
            log_dir = tmp / f"logs-{engine}-{round_}-{config.name.replace(' ', '_').replace('/', '')}"
            with Deployment(config, engine, model_dir, log_dir, max_model_len=MAX_MODEL_LEN, worker_args=worker_args,
                            startup_s=STARTUP_S[engine]) as dep:
                startup.setdefault(config.name, []).append(dep.started_s)
                measure_config(dep, args, round_, runs, all_unloaded, stages, cpu, say)
    slos = {name: slo_for(all_unloaded[name], args.ttft_x, args.tpot_x) for name in args.workloads}
    summary = summarise(runs, slos, args.target)
    cores = {c.name: c.cores for c in configs}
    for line in table(engine, summary, slos, cores):
        say(line)
    mean_stages = {c: {w: {rate: {k: statistics.mean(s[k] for s in rounds) for k in rounds[0]}
                           for rate, rounds in by_rate.items()} for w, by_rate in by_w.items()}
                   for c, by_w in stages.items()}
    for c, by_w in mean_stages.items():
        for w, by_rate in by_w.items():
            say(f"\n[{engine}] {c} {w}: mean TTFT by stage (ms, mean over rounds):")
            for rate, st in by_rate.items():
                say(f"  {rate:>5g} req/s: " + ", ".join(f"{k} {v * 1000:.1f}" for k, v in st.items()))
    say(f"\n[{engine}] worker CPU ms per request (mean over rounds; compute, whatever else ran on the machine):")
    for c, by_w in cpu.items():
        for w, by_key in by_w.items():
            say(f"  {c:<24} {w:<14} " + "; ".join(
                f"{k if k == 'unloaded' else f'{k:g} req/s'}: " + ", ".join(
                    f"{role} {statistics.mean(x[role] for x in rounds) * 1000:.0f}" for role in rounds[0])
                for k, rounds in by_key.items()))
    out = {"slos": slos, "summary": summary, "stages": mean_stages, "cpu_s_per_request": cpu, "startup_s": startup,
           "raw": {c: {w: {"unloaded": [[asdict(r) for r in rnd] for rnd in run["unloaded"]],
                           "rates": {str(rate): [[asdict(r) for r in rnd] if rnd else None for rnd in rounds]
                                     for rate, rounds in run["rates"].items()}}
                       for w, run in by_w.items()} for c, by_w in runs.items()}}
    pd = next((c for c in configs if c.pd and c.prefill == 1 and c.decode == 1), None)
    if args.save_capacity and pd:
        cap = fit_capacity(runs[pd.name], load.WORKLOADS, slos, statistics.median(startup[pd.name]), engine)
        path = Path(args.save_capacity)
        path = path.with_name(f"{path.stem}-{engine}{path.suffix}")
        path.write_text(json.dumps(cap, indent=1))
        out["capacity"] = cap
        say(f"\n[{engine}] capacity model for bench/autoscale_sim.py --capacity {path}: prefill "
            f"{cap['prefill_fixed_s'] * 1e3:.1f} ms + {cap['prefill_per_token_s'] * 1e6:.1f} us/token, decode step "
            f"{cap['decode_step_fixed_s'] * 1e3:.2f} ms + {cap['decode_step_per_seq_s'] * 1e3:.3f} ms/seq, "
            f"start-up {cap['startup_s']:.1f} s")
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", nargs="+", choices=["disagg", "vllm"], default=["disagg"])
    p.add_argument("--workloads", nargs="+", choices=list(load.WORKLOADS), default=list(load.WORKLOADS))
    p.add_argument("--configs", nargs="+", default=["pd:1:1", "colo:2", "colo1:2"],
                   help="pd:P:D (one core per worker), colo:N (N colocated workers, one core each), colo1:C (one "
                        "colocated worker on C cores)")
    p.add_argument("--rates", type=float, nargs="+", help="req/s for every workload (default: per workload)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seconds-per-rate", type=float, default=6.0)
    p.add_argument("--min-requests", type=int, default=10, help="per rate")
    p.add_argument("--unloaded", type=int, default=10, help="unloaded samples per workload, config and round")
    p.add_argument("--drain-s", type=float, default=30.0, help="after the last arrival; unfinished then = missed")
    p.add_argument("--ttft-x", type=float, default=5.0)
    p.add_argument("--tpot-x", type=float, default=2.0)
    p.add_argument("--target", type=float, default=0.9, help="goodput: attainment needed")
    p.add_argument("--stop-below", type=float, default=0.5, help="stop climbing rates below this attainment")
    p.add_argument("--max-num-batched-tokens", type=int, help="our engine's token budget per step (default: "
                   "the worker's)")
    p.add_argument("--quick", action="store_true", help="smoke run: 1 round, 3 rates, short windows")
    p.add_argument("--json", default="goodput.json", help="everything measured, raw requests included")
    p.add_argument("--plot", metavar="PNG", help="attainment vs rate per workload (needs matplotlib)")
    p.add_argument("--save-capacity", metavar="JSON", help="write a capacity model per engine (NAME-ENGINE.json) "
                   "fitted from the P/D measurements, for bench/autoscale_sim.py --capacity")
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.seconds_per_rate, args.min_requests, args.unloaded = 1, 5.0, 8, 6
        args.rates = args.rates or None
        if not args.rates:
            RATES.update(QUICK_RATES)
    return args


def main() -> int:
    args = parse_args()
    configs = [parse_config(c) for c in args.configs]
    say = lambda line: print(line, flush=True)  # noqa: E731
    if "vllm" in args.engine:
        from disagg.worker.local.launcher import find_vllm

        find_vllm()  # fail before measuring anything
    t0 = time.monotonic()
    say(f"goodput: {', '.join(c.name for c in configs)}; workloads {', '.join(args.workloads)}; {args.rounds} "
        f"round(s); {os.cpu_count()} CPUs, load {os.getloadavg()}")
    results = {"args": vars(args), "machine": {"cpus": os.cpu_count(), "uname": " ".join(os.uname())}, "engines": {}}
    with tempfile.TemporaryDirectory(prefix="bench-goodput-") as d:
        from disagg.worker.model import write_tiny_checkpoint

        model_dir = str(write_tiny_checkpoint(Path(d) / "model", hidden_size=256, num_heads=4, num_kv_heads=2,
                                              intermediate_size=512, num_layers=2,
                                              max_position_embeddings=MAX_MODEL_LEN))
        for engine in args.engine:
            results["engines"][engine] = run_engine(engine, args, configs, model_dir, Path(d), say)
    results["wall_s"] = time.monotonic() - t0
    results["load_after"] = os.getloadavg()
    Path(args.json).write_text(json.dumps(results, indent=1, default=str))
    say(f"\n{time.monotonic() - t0:.0f} s; load now {os.getloadavg()}; everything in {args.json}")
    if args.plot:
        from plots import plot_goodput

        plot_goodput(args.plot, {e: r["summary"] for e, r in results["engines"].items()},
                     {e: r["slos"] for e, r in results["engines"].items()})
        say(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
