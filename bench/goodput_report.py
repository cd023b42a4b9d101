"""bench/goodput.py's arithmetic (pure): SLOs from unloaded samples, attainment per rate and round, goodput,
latency percentiles, the final table, and a per-pod capacity model for bench/autoscale_sim.py fitted from the
measurements."""
from __future__ import annotations

import math
import statistics
from dataclasses import asdict
from typing import Any

from goodput_load import Result

# runs[config][workload] = {"unloaded": [[Result] per round], "rates": {rate: [[Result] per round, None: not run]}}
Runs = dict[str, dict[str, dict[str, Any]]]


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank; a failed request counts as infinitely slow."""
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(math.ceil(q * len(values)) - 1, len(values) - 1)] if q > 0 else values[0]


def slo_for(unloaded: list[Result], ttft_x: float, tpot_x: float) -> dict[str, float]:
    """TTFT and TPOT limits: the given multiples of the median of every unloaded sample given."""
    ok = [r for r in unloaded if r.ok]
    if not ok:
        raise SystemExit("no unloaded request succeeded; nothing to derive SLOs from (see the workers' logs)")
    ttft, tpot = statistics.median(r.ttft for r in ok), statistics.median(r.tpot for r in ok)
    return {"ttft_s": ttft_x * ttft, "tpot_s": tpot_x * tpot, "unloaded_ttft_median_s": ttft,
            "unloaded_tpot_median_s": tpot, "samples": len(ok), "ttft_x": ttft_x, "tpot_x": tpot_x}


def attained(results: list[Result] | None, slo: dict[str, float]) -> float:
    """Fraction of the requests inside both SLOs; a rate not run (stopped above the knee) counts 0."""
    if not results:
        return 0.0
    return sum(r.ok and r.ttft <= slo["ttft_s"] and r.tpot <= slo["tpot_s"] for r in results) / len(results)


def goodput(rates: list[float], fractions: list[float], target: float) -> float:
    """The highest rate whose attainment, and that of every lower rate, is >= target (0: the lowest misses)."""
    best = 0.0
    for rate, frac in sorted(zip(rates, fractions)):
        if frac < target:
            break
        best = rate
    return best


def summarise(runs: Runs, slos: dict[str, dict], target: float) -> dict[str, dict[str, dict]]:
    """Per config and workload: attainment per rate (mean, min, max over rounds), goodput per round and its
    median, TTFT/TPOT p50/p90/p99 per rate over the rounds' requests."""
    out: dict[str, dict[str, dict]] = {}
    for config, by_workload in runs.items():
        for workload, run in by_workload.items():
            slo, rates = slos[workload], sorted(run["rates"])
            rounds = len(run["unloaded"])
            per_round = [[attained(run["rates"][rate][i], slo) for rate in rates] for i in range(rounds)]
            goodputs = [goodput(rates, fr, target) for fr in per_round]
            lat = {}
            for rate in rates:
                rs = [r for rnd in run["rates"][rate] if rnd for r in rnd]
                lat[rate] = {f"{k}_p{q}": percentile([getattr(r, k) if r.ok else math.inf for r in rs], q / 100)
                             for k in ("ttft", "tpot") for q in (50, 90, 99)}
                lat[rate]["requests"] = len(rs)
            att = {rate: {"mean": statistics.mean(fr[i] for fr in per_round), "min": min(fr[i] for fr in per_round),
                          "max": max(fr[i] for fr in per_round)} for i, rate in enumerate(rates)}
            out.setdefault(config, {})[workload] = {
                "attainment": att, "goodput_per_round": goodputs, "goodput": statistics.median(goodputs),
                "latency": lat}
    return out


def ms(s: float) -> str:
    return "-" if math.isinf(s) or math.isnan(s) else f"{s * 1000:.0f}"


def table(engine: str, summary: dict, slos: dict, cores: dict[str, int]) -> list[str]:
    """The final table: per workload, each config's attainment curve, goodput and latencies at its goodput."""
    lines = []
    for workload, slo in slos.items():
        lines.append(f"\n[{engine}] {workload}: SLO TTFT <= {slo['ttft_s'] * 1000:.0f} ms ({slo['ttft_x']:g}x the "
                     f"unloaded median {slo['unloaded_ttft_median_s'] * 1000:.1f} ms), TPOT <= "
                     f"{slo['tpot_s'] * 1000:.2f} ms ({slo['tpot_x']:g}x {slo['unloaded_tpot_median_s'] * 1000:.2f}"
                     f" ms); medians of {slo['samples']} unloaded requests over every configuration and round")
        for config, by_w in summary.items():
            s = by_w.get(workload)
            if not s:
                continue
            curve = "  ".join(f"{rate:g}:{a['mean']:.0%}" + (f"({a['min']:.0%}-{a['max']:.0%})"
                                                             if a['max'] - a['min'] > 0.005 else "")
                              for rate, a in s["attainment"].items())
            spread = "/".join(f"{g:g}" for g in s["goodput_per_round"])
            lines.append(f"  {config:<24} goodput {s['goodput']:>5g} req/s ({s['goodput'] / cores[config]:.2g} per "
                         f"core; rounds {spread})  attainment by rate: {curve}")
            for rate, lat in s["latency"].items():
                lines.append(f"  {'':<24}   {rate:>5g} req/s ({lat['requests']:>3} req): TTFT p50/p90/p99 "
                             f"{ms(lat['ttft_p50'])}/{ms(lat['ttft_p90'])}/{ms(lat['ttft_p99'])} ms  TPOT "
                             f"{ms(lat['tpot_p50'] * 1000)}/{ms(lat['tpot_p90'] * 1000)}/"
                             f"{ms(lat['tpot_p99'] * 1000)} us")
        pd = [s[workload]["goodput"] for c, s in summary.items() if c.startswith("P/D") and workload in s]
        colo = [s[workload]["goodput"] for c, s in summary.items() if not c.startswith("P/D") and workload in s]
        if pd and colo:
            ratio = max(pd) / max(colo) if max(colo) else math.inf
            lines.append(f"  P/D goodput / best colocated: {ratio:.2f}x")
    return lines


def _fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    b = max(sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var, 0.0) if var else 0.0
    return my - b * mx, b


def fit_capacity(run: dict[str, dict], workloads: dict, slos: dict, startup_s: float, engine: str) -> dict:
    """A PodCapacity (bench/autoscale_sim_capacity.py) from one P/D configuration's measurements: prefill time vs
    prompt tokens from the unloaded TTFTs (no shared-prefix workload: its prompts hit the cache); the decode step
    vs batch from each loaded rate's mean TPOT against its mean decode batch (Little: rate x output tokens x TPOT);
    start-up as measured. KV sizes and the transfer's fixed cost stay the GPU profile's (not measured here)."""
    from autoscale_sim_capacity import GPU_H100_LLAMA8B

    xs, ys, unloaded_tpots, points = [], [], [], []
    for name, r in run.items():
        ok = [x for rnd in r["unloaded"] for x in rnd if x.ok]
        unloaded_tpots += [x.tpot for x in ok]
        if not workloads[name].shared_prefix:
            xs += [x.prompt_tokens for x in ok]
            ys += [x.ttft for x in ok]
        out_mean = sum(workloads[name].output) / 2
        for rate, rounds in r["rates"].items():
            every = [x for rnd in rounds if rnd for x in rnd]
            done = [x for x in every if x.ok]
            if done and attained(every, slos[name]) >= 0.5:  # past the knee the queue, not the step, sets TPOT
                tpot = statistics.mean(x.tpot for x in done)
                points.append((rate * out_mean * tpot, tpot))  # (mean decode batch, step)
    points.append((1.0, statistics.median(unloaded_tpots)))
    pa, pb = _fit_line(xs, ys)
    da, db = _fit_line([b for b, _ in points], [t for _, t in points])
    cap = asdict(GPU_H100_LLAMA8B)
    cap.update(source=f"fitted from bench/goodput.py's {engine} P/D measurements on this machine (one core per pod)",
               prefill_fixed_s=max(pa, 0.0), prefill_per_token_s=pb, decode_step_fixed_s=max(da, 1e-4),
               decode_step_per_seq_s=db, startup_s=startup_s)
    return cap
