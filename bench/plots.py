"""Figures for the bench scripts (`--plot FILE.png`): matplotlib, a bench-only dependency
(`pip install -e '.[bench]'`), imported only when a plot is asked for."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as e:
        raise SystemExit("--plot needs matplotlib: pip install -e '.[bench]'") from e
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt
    return plt


# ---------------------------------------------------------------- autoscaling over time
@dataclass
class Timeline:
    """One policy's run, sampled at each autoscaling decision."""

    name: str
    times: list[float] = field(default_factory=list)  # s, simulated
    replicas: dict[str, list[int]] = field(default_factory=lambda: {"prefill": [], "decode": []})  # active pods


def recording(controller: Callable, timeline: Timeline) -> Callable:
    """The controller, unchanged, noting the active pods per role at each decision."""
    def control(sim: Any, t: float) -> dict[str, int]:
        timeline.times.append(t)
        for role, values in timeline.replicas.items():
            values.append(len(sim.active(role)))
        return controller(sim, t)
    return control


def _binned(times: list[float], ok: list[bool], width: float, end: float) -> tuple[list[float], list[float]]:
    """(bin centres, percent ok per bin) of events at `times`; bins without events are left out."""
    n = int(end // width) + 1
    total, good = [0] * n, [0] * n
    for t, k in zip(times, ok):
        i = min(int(t // width), n - 1)
        total[i] += 1
        good[i] += k
    keep = [i for i in range(n) if total[i]]
    return [(i + 0.5) * width for i in keep], [100.0 * good[i] / total[i] for i in keep]


def plot_autoscaling(path: str, arrivals: list[float], timelines: list[Timeline],
                     attainment: dict[str, tuple[list[float], list[bool]]], duration: float, title: str) -> None:
    """Load (requests/s), replicas per role and SLO attainment (TTFT and ITL both met, by arrival minute) over
    time, one line per policy. attainment: policy -> (arrival times, met both SLOs)."""
    plt = _pyplot()
    width = max(duration / 120, 30.0)  # s per bin
    fig, axes = plt.subplots(4, 1, figsize=(11, 11), sharex=True)
    counts = _counts(arrivals, width, duration)
    axes[0].fill_between([c for c, _ in counts], [n / width for _, n in counts], step="mid", alpha=0.4)
    axes[0].set_ylabel("load (req/s)")
    for ax, role in ((axes[1], "prefill"), (axes[2], "decode")):
        for tl in timelines:
            ax.step(tl.times, tl.replicas[role], where="post", label=tl.name)
        ax.set_ylabel(f"{role} replicas")
    for tl in timelines:
        times, ok = attainment[tl.name]
        bx, pct = _binned(times, ok, width, duration)
        axes[3].plot(bx, pct, label=tl.name)
    axes[3].set_ylabel("SLO attainment (%)")
    axes[3].set_ylim(0, 101)
    axes[3].set_xlabel("time (s, simulated)")
    axes[1].legend(loc="upper left", fontsize="small")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _counts(times: list[float], width: float, end: float) -> list[tuple[float, int]]:
    n = int(end // width) + 1
    counts = [0] * n
    for t in times:
        counts[min(int(t // width), n - 1)] += 1
    return [((i + 0.5) * width, c) for i, c in enumerate(counts)]


# ---------------------------------------------------------------- latency distributions
def plot_latency_cdfs(path: str, runs: dict[str, dict[float, dict[str, list[float]]]], title: str) -> None:
    """TTFT and ITL CDFs: runs = deployment -> rate -> {"ttfts": [s], "itls": [s]}; one line per deployment
    and rate."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, key, label in ((axes[0], "ttfts", "time to first token (ms)"), (axes[1], "itls", "inter-token latency (ms)")):
        for name, by_rate in runs.items():
            for rate, r in sorted(by_rate.items()):
                values = sorted(v * 1000 for v in r[key])
                if values:
                    ax.step(values, [(i + 1) / len(values) for i in range(len(values))], where="post",
                            label=f"{name}, {rate:g} req/s")
        ax.set_xscale("log")
        ax.set_xlabel(label)
        ax.set_ylabel("fraction of requests" if key == "ttfts" else "fraction of token gaps")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize="small")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


# ---------------------------------------------------------------- goodput (bench/goodput.py)
def plot_goodput(path: str, summaries: dict[str, dict], slos: dict[str, dict]) -> None:
    """SLO attainment vs request rate, one panel per engine and workload, one line per configuration with its
    round-to-round spread shaded; the goodput target drawn at 90%. summaries: engine -> goodput_report.summarise."""
    plt = _pyplot()
    panels = [(e, w) for e, s in summaries.items() for w in slos[e]]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4.2), squeeze=False)
    for ax, (engine, workload) in zip(axes[0], panels):
        for config, by_w in summaries[engine].items():
            att = by_w.get(workload, {}).get("attainment", {})
            rates = sorted(att, key=float)
            ax.plot(rates, [100 * att[r]["mean"] for r in rates], marker="o",
                    label=f"{config} (goodput {by_w[workload]['goodput']:g})")
            ax.fill_between(rates, [100 * att[r]["min"] for r in rates], [100 * att[r]["max"] for r in rates],
                            alpha=0.2)
        slo = slos[engine][workload]
        ax.axhline(90, color="grey", linestyle="--", linewidth=0.8)
        ax.set_title(f"{engine}: {workload}\nTTFT <= {slo['ttft_s'] * 1000:.0f} ms, TPOT <= "
                     f"{slo['tpot_s'] * 1000:.1f} ms", fontsize="medium")
        ax.set_xlabel("request rate (req/s, Poisson)")
        ax.set_ylabel("requests within both SLOs (%)")
        ax.set_ylim(0, 101)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
