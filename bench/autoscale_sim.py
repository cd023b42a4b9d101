"""Autoscaling replay: a bursty trace against per-pod capacity models, three ways of provisioning.

- ours: disagg.operator.autoscaling.policy.decide on the pods' exported metrics (queue, prompt tokens, TTFT,
  KV usage, ITL, KV-transfer), projecting demand one pod start-up ahead.
- static peak: fixed pools sized for the trace's busiest minute (spikes included) plus 10% headroom.
- queue per role: each pool scaled on its own vllm:num_requests_waiting (the common KEDA recipe), same HPA
  machinery (tolerance, down window, step) so only the signals differ.

Capacities are measured from the real engine in this run (default) or taken from a fixed GPU profile
(`--profile gpu`, reproducible). The trace's rate is set from the capacity so the busier pool needs about `--peak-pods`
pods at its busiest minute; the KV fabric is sized with `--fabric-headroom` over the peak KV rate and is
congested (x`--jam-factor`, default 0.2) for 150 s mid-morning, so a transfer-bound episode exists.
SLOs: TTFT <= 15x the prefill time of a 1024-token prompt; per-request mean ITL <= the decode step at 75% of max_num_seqs.

    python bench/autoscale_sim.py [--profile measured|gpu] [--duration 7200] [--seed 0]
    python bench/autoscale_sim.py --save-capacity cap.json   # measure once; replay with --capacity cap.json
    python bench/autoscale_sim.py --profile gpu --plot autoscale.png   # load, replicas, SLO attainment over time
    python bench/autoscale_sim.py --capacity cap-disagg.json --workload chat --ratio-sweep   # best static P:D vs ours
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import math
import time

from autoscale_sim_capacity import GPU_H100_LLAMA8B, PodCapacity, measure_capacity
from autoscale_sim_model import Simulation
from autoscale_sim_trace import CHAT, GENERATE, RAG, SINGLE, TraceRequest, make_trace
from plots import Timeline, plot_autoscaling, recording

from disagg.operator.autoscaling.policy import ScalingHistory, decide
from disagg.operator.autoscaling.inputs import AutoscalePolicy, RoleBounds

INTERVAL_S = 15.0
DOWN_WINDOW_S = 180.0
MAX_STEP = 4
LOGNORMAL_MEAN = math.exp(0.5 ** 2 / 2)  # mean/median of the trace's prompt lengths (sigma 0.5)


def slos(cap: PodCapacity) -> tuple[float, float]:
    return 15 * cap.prefill_s(1024), cap.step_s(int(0.75 * cap.decode_max_seqs))


def static_peak(cap: PodCapacity, trace: list[TraceRequest], itl_slo: float) -> tuple[int, int]:
    """Pods for the busiest minute: prefill busy-seconds per second; decode batch (Little's law) at 90% of the ITL
    SLO, or KV, whichever binds; plus 10% headroom."""
    batch = max(1, min(cap.decode_max_seqs, int((0.9 * itl_slo - cap.decode_step_fixed_s) / cap.decode_step_per_seq_s)))
    step = cap.step_s(batch)
    work, conc, kv = collections.Counter(), collections.Counter(), collections.Counter()
    for r in trace:
        minute = int(r.arrival // 60)
        work[minute] += cap.prefill_s(r.prompt) / 60
        conc[minute] += r.output * step / 60
        kv[minute] += r.output * step / 60 * (r.prompt + r.output)
    p = math.ceil(1.1 * max(work.values()))
    d = math.ceil(1.1 * max(max(c / batch for c in conc.values()), max(k / cap.decode_kv_tokens for k in kv.values())))
    return p, d


# ---------------------------------------------------------------- controllers: (sim, now) -> desired replicas
def static_controller(p: int, d: int):
    return lambda sim, t: {"prefill": p, "decode": d}


def ours_controller(policy: AutoscalePolicy, reasons: collections.Counter):
    history = ScalingHistory()

    def control(sim: Simulation, t: float) -> dict[str, int]:
        nonlocal history
        current = {r: len(sim.active(r)) for r in ("prefill", "decode")}
        d = decide(sim.samples(t), current, policy, history, t)
        history = d.history
        reasons[d.reason] += 1
        return d.desired
    return control


def queue_controller(waiting_per_pod: float, bounds: dict[str, RoleBounds], tolerance: float = 0.1):
    """HPA on vllm:num_requests_waiting per role, each role alone (KEDA's prometheus trigger, AverageValue)."""
    recs: dict[str, list[tuple[float, int]]] = {"prefill": [], "decode": []}

    def control(sim: Simulation, t: float) -> dict[str, int]:
        out = {}
        for role in ("prefill", "decode"):
            cur = len(sim.active(role))
            waiting = len(sim.prefill_queue) if role == "prefill" else len(sim.decode_wait)
            ratio = waiting / (waiting_per_pod * max(cur, 1))
            rec = cur if abs(ratio - 1) <= tolerance else math.ceil(max(cur, 1) * ratio)
            recs[role] = [(s, n) for s, n in recs[role] if t - s <= DOWN_WINDOW_S] + [(t, rec)]
            want = rec if rec > cur else min(cur, max(n for _, n in recs[role]))
            want = max(cur - MAX_STEP, min(cur + MAX_STEP, want))
            b = bounds[role]
            out[role] = max(b.min_replicas, min(b.max_replicas, want))
        return out
    return control


# ---------------------------------------------------------------- running and scoring
def score(sim: Simulation, ttft_slo: float, itl_slo: float) -> tuple[float, float, float]:
    n = len(sim.reqs)
    ttft_ok = [0 <= r.first_token and r.first_token - r.spec.arrival <= ttft_slo for r in sim.reqs]
    itl_ok = [0 <= r.finished and r.itl <= itl_slo for r in sim.reqs]
    both = sum(a and b for a, b in zip(ttft_ok, itl_ok))
    return 100 * sum(ttft_ok) / n, 100 * sum(itl_ok) / n, 100 * both / n


def slos_met(sim: Simulation, ttft_slo: float, itl_slo: float) -> list[bool]:
    """Per request (trace order): finished within both SLOs (for --plot's attainment over time)."""
    return [0 <= r.first_token and r.first_token - r.spec.arrival <= ttft_slo and 0 <= r.finished and r.itl <= itl_slo
            for r in sim.reqs]


def ratio_sweep(cap: PodCapacity, trace: list[TraceRequest], fabric, total: int, args: argparse.Namespace,
                slo: tuple[float, float], ours: Timeline) -> None:
    """Static pools of `total` pods split every way (up to ~16 splits): SLO attainment per P:D split, the best one,
    and the prefill share our policy held - does the autoscaler land near the best static ratio?"""
    step = max(1, (total - 1) // 16)
    rows = []
    for p in range(1, total, step):
        sim = Simulation(cap, trace, fabric, {"prefill": p, "decode": total - p}, dt=args.dt)
        sim.run(static_controller(p, total - p), INTERVAL_S, args.duration)
        rows.append((score(sim, *slo)[2], p))
    print(f"\nstatic P:D splits of {total} pods (SLO attainment, both):")
    print("  " + "  ".join(f"{p}:{total - p} {both:.1f}%" for both, p in rows))
    best_both, best_p = max(rows)
    near = [p for both, p in rows if both >= best_both - 1.0]  # splits within a point of the best: a plateau
    # the split ours chose, three ways: its mean prefill share over time (night hours weigh as much as the peak), its
    # prefill share of all pod-seconds (what the pools cost: the hours with many pods weigh most), and its share at
    # its busiest - the decisions with at least 80% of the swept pool size, the scale the sweep compares at
    held = [(p, d) for p, d in zip(ours.replicas["prefill"], ours.replicas["decode"]) if p + d]
    busy = [(p, d) for p, d in held if p + d >= 0.8 * total]

    def share(pools: list[tuple[int, int]]) -> float:
        return sum(p for p, _ in pools) / max(1, sum(p + d for p, d in pools))

    mean_share = sum(p / (p + d) for p, d in held) / len(held)
    pod_share, busy_share, best = share(held), share(busy), best_p / total
    print(f"  best static split {best_p}:{total - best_p} (prefill share {best:.0%}, {best_both:.1f}%); within a "
          f"point of it: prefill shares {min(near) / total:.0%}-{max(near) / total:.0%}")
    print(f"  ours: prefill share {pod_share:.0%} of pod-seconds ({abs(pod_share - best) / best:.0%} from the best "
          f"static share), {mean_share:.0%} mean over time ({abs(mean_share - best) / best:.0%} from it), "
          + (f"{busy_share:.0%} at its busiest ({len(busy)} decisions with >= {0.8 * total:.0f} pods; "
             f"{abs(busy_share - best) / best:.0%} from it)" if busy else f"never at >= {0.8 * total:.0f} pods"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", choices=["measured", "gpu"], default="measured")
    ap.add_argument("--duration", type=float, default=7200.0, help="simulated seconds (one compressed day)")
    ap.add_argument("--peak-pods", type=float, default=16.0, help="pods the busier pool needs at peak")
    ap.add_argument("--fabric-headroom", type=float, default=2.5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jam-factor", type=float, default=0.2, help="fabric bandwidth during the congestion episode")
    ap.add_argument("--dt", type=float, default=0.2)
    ap.add_argument("--save-capacity", metavar="JSON", help="write the capacity used (to replay a measured one)")
    ap.add_argument("--capacity", metavar="JSON", help="replay a capacity written by --save-capacity")
    ap.add_argument("--ratio-sweep", action="store_true", help="also replay static pools of the static-peak size "
                    "split every P:D way, and compare the best split with the prefill share our policy held")
    ap.add_argument("--workload", choices=["mixed", *SINGLE], default="mixed", help="the trace's requests: the "
                    "day's drifting mix (RAG mornings, generation evenings), or one of bench/goodput.py's workloads")
    ap.add_argument("--plot", metavar="PNG", help="draw load, replicas per role and SLO attainment over time, "
                    "ours vs the baselines (needs matplotlib: pip install -e '.[bench]')")
    args = ap.parse_args()

    if args.capacity:
        with open(args.capacity) as f:
            cap, raw = PodCapacity(**json.load(f)), None
    elif args.profile == "gpu":
        cap, raw = GPU_H100_LLAMA8B, None
    else:
        cap, raw = measure_capacity()
    if args.save_capacity:
        with open(args.save_capacity, "w") as f:
            json.dump(dataclasses.asdict(cap), f, indent=1)
    ttft_slo, itl_slo = slos(cap)
    only = SINGLE.get(args.workload)
    morning_prompt = only.prompt_median if only else (
        0.4 * RAG.prompt_median + 0.1 * GENERATE.prompt_median + 0.5 * CHAT.prompt_median)
    morning_prompt *= LOGNORMAL_MEAN
    trial_rps = 10.0  # size the rate so the busier pool needs --peak-pods at its busiest minute
    p_trial, d_trial = static_peak(cap, make_trace(args.duration, trial_rps, args.seed, only)[0], itl_slo)
    peak_rps = trial_rps * args.peak_pods / max(p_trial, d_trial)
    trace, bursts = make_trace(args.duration, peak_rps, args.seed, only)
    bandwidth = args.fabric_headroom * peak_rps * morning_prompt  # KV tokens/s
    jam = (0.5 * args.duration, 0.5 * args.duration + 150)
    fabric = lambda t: bandwidth * (args.jam_factor if jam[0] <= t < jam[1] else 1.0)  # noqa: E731
    p_static, d_static = static_peak(cap, trace, itl_slo)
    bounds = {"prefill": RoleBounds(1, 2 * p_static), "decode": RoleBounds(1, 2 * d_static)}

    policy = AutoscalePolicy(
        prefill=bounds["prefill"], decode=bounds["decode"], waiting_requests_per_pod=2, ttft_seconds=0.4 * ttft_slo,
        kv_cache_usage=0.7, itl_seconds=0.8 * itl_slo, xfer_time_seconds=0.1 * ttft_slo, pending_sends_per_pod=4,
        tolerance=0.1, scale_up_window_seconds=0, scale_down_window_seconds=DOWN_WINDOW_S, max_step=MAX_STEP,
        stale_after_seconds=3 * INTERVAL_S, latency_quantile=0.9,
        # predictive scale-up over the pods' start-up, sized for 80% busy prefill pods, HPA's default step (x2);
        # in a spec: stabilization.scaleUpLookaheadSeconds, targets.prefill.utilizationPercent: 80,
        # maxStepPercentPerInterval: 100
        scale_up_lookahead_seconds=cap.startup_s, prefill_utilization=0.8, max_step_percent=100,
    )
    print(f"capacity: {cap.source}")
    if raw:
        print(f"  measured prefill s by prompt {raw['prefill_s_by_prompt']}, decode step s by batch "
              f"{raw['step_s_by_batch']}")
    print(f"  prefill {cap.prefill_fixed_s * 1e3:.1f} ms + {cap.prefill_per_token_s * 1e6:.0f} us/token; "
          f"decode step {cap.decode_step_fixed_s * 1e3:.1f} ms + {cap.decode_step_per_seq_s * 1e3:.2f} ms/seq, "
          f"max {cap.decode_max_seqs} seqs; start-up {cap.startup_s:.0f} s")
    print(f"trace ({args.workload}): {len(trace)} requests over {args.duration:.0f} s, peak {peak_rps:.1f} req/s "
          f"before spikes, {len(bursts)} spikes; fabric {bandwidth:.0f} KV tokens/s, x{args.jam_factor} during "
          f"{jam[0]:.0f}-{jam[1]:.0f} s")
    print(f"SLOs: TTFT <= {ttft_slo:.2f} s, mean ITL <= {itl_slo * 1e3:.1f} ms; static peak {p_static}P + {d_static}D")

    reasons: collections.Counter = collections.Counter()
    runs = [("ours (KV-transfer aware)", ours_controller(policy, reasons), (1, 1)),
            ("static peak", static_controller(p_static, d_static), (p_static, d_static)),
            ("queue per role (KEDA)", queue_controller(2, bounds), (1, 1))]
    rows, timelines, attainment = [], [], {}
    for name, controller, (p0, d0) in runs:
        t0 = time.perf_counter()
        sim = Simulation(cap, trace, fabric, {"prefill": p0, "decode": d0}, dt=args.dt)
        timelines.append(Timeline(name))
        end = sim.run(recording(controller, timelines[-1]), INTERVAL_S, args.duration)
        ttft, itl, both = score(sim, ttft_slo, itl_slo)
        attainment[name] = ([r.spec.arrival for r in sim.reqs], slos_met(sim, ttft_slo, itl_slo))
        rows.append((name, ttft, itl, both, sim.pod_seconds(end), time.perf_counter() - t0))
    static_ps = rows[1][4]
    print()
    print(f"{'policy':<26}{'TTFT SLO %':>11}{'ITL SLO %':>11}{'both %':>9}{'pod-seconds':>13}{'% of static':>13}"
          f"{'sim s':>7}")
    for name, ttft, itl, both, ps, wall in rows:
        print(f"{name:<26}{ttft:>11.2f}{itl:>11.2f}{both:>9.2f}{ps:>13.0f}{100 * ps / static_ps:>12.1f}%{wall:>7.1f}")
    print(f"\nours, decisions by reason: {dict(reasons.most_common())}")
    ours, base = rows[0], rows[2]
    checks = [(f"ours >= 95% SLO attainment (both): {ours[3]:.2f}%", ours[3] >= 95),
              (f"ours <= 70% of static-peak pod-seconds: {100 * ours[4] / static_ps:.1f}%", ours[4] <= 0.7 * static_ps),
              (f"ours attainment above queue-per-role: {ours[3]:.2f}% vs {base[3]:.2f}%", ours[3] > base[3]),
              (f"ours cost at or below queue-per-role: {ours[4]:.0f} vs {base[4]:.0f} pod-s", ours[4] <= base[4])]
    for text, ok in checks:
        print(f"  {'MET    ' if ok else 'NOT MET'} {text}")
    if args.ratio_sweep:
        ratio_sweep(cap, trace, fabric, p_static + d_static, args, (ttft_slo, itl_slo), timelines[0])
    if args.plot:
        plot_autoscaling(args.plot, [r.arrival for r in trace], timelines, attainment, args.duration,
                         f"Autoscaling replay ({cap.source.split(' (')[0]}): TTFT <= {ttft_slo:.2f} s, mean ITL <= "
                         f"{itl_slo * 1e3:.0f} ms")
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
