"""A bursty request trace for bench/autoscale_sim.py: a day's diurnal curve compressed into `duration_s`, a few
sudden spikes, and a request mix whose shape drifts over the day (long-prompt RAG in the morning, long-output
generation in the evening), so prefill and decode peak at different times. Deterministic for a seed."""
from __future__ import annotations

import math
import random
from dataclasses import dataclass

from goodput_load import WORKLOADS


@dataclass
class TraceRequest:
    arrival: float  # seconds from the trace start
    prompt: int  # prompt tokens
    output: int  # tokens to generate


@dataclass(frozen=True)
class RequestClass:
    name: str
    prompt_median: int
    output_median: int


CHAT = RequestClass("chat", 600, 200)
RAG = RequestClass("rag", 3000, 80)
GENERATE = RequestClass("generate", 250, 700)
# bench/goodput.py's workloads, one class each (medians at the middle of its uniform length ranges); its shared-prefix
# workload has no counterpart: the simulation models no prefix cache
SINGLE = {w.name: RequestClass(w.name, sum(w.prompt) // 2, sum(w.output) // 2)
          for w in WORKLOADS.values() if not w.shared_prefix}


def diurnal(x: float) -> float:
    """Load at fraction x of the day, 0.2 at night to 1.0 at the busiest hour (two humps, as user traffic has)."""
    morning = math.exp(-((x - 0.40) / 0.12) ** 2)
    evening = 0.9 * math.exp(-((x - 0.75) / 0.10) ** 2)
    return 0.2 + 0.8 * max(morning, evening)


def mix(x: float) -> list[tuple[RequestClass, float]]:
    """Class weights at fraction x of the day: RAG heavy around the morning peak, generation in the evening."""
    rag = 0.10 + 0.30 * math.exp(-((x - 0.40) / 0.10) ** 2)
    gen = 0.10 + 0.35 * math.exp(-((x - 0.75) / 0.10) ** 2)
    return [(RAG, rag), (GENERATE, gen), (CHAT, 1.0 - rag - gen)]


def spikes(duration_s: float, rng: random.Random, count: int = 4) -> list[tuple[float, float, float]]:
    """(start, length, extra load): sudden bursts of +60..100% lasting 1-3 minutes."""
    return [(rng.uniform(0.15, 0.9) * duration_s, rng.uniform(60, 180), rng.uniform(0.6, 1.0)) for _ in range(count)]


def rate_at(t: float, duration_s: float, peak_rps: float, bursts: list[tuple[float, float, float]]) -> float:
    extra = sum(h for start, length, h in bursts if start <= t < start + length)
    return peak_rps * diurnal(t / duration_s) * (1.0 + extra)


def _lognormal(rng: random.Random, median: int, sigma: float, lo: int, hi: int) -> int:
    return int(min(hi, max(lo, median * math.exp(rng.gauss(0.0, sigma)))))


def make_trace(duration_s: float, peak_rps: float, seed: int = 0,
               only: RequestClass | None = None) -> tuple[list[TraceRequest], list]:
    """Poisson arrivals at rate_at(t) (thinning), lengths lognormal around each class's median; the drifting mix of
    `mix`, or `only` that class all day."""
    rng = random.Random(seed)
    bursts = spikes(duration_s, rng)
    ceiling = peak_rps * 2.0
    t, out = 0.0, []
    while True:
        t += rng.expovariate(ceiling)
        if t >= duration_s:
            return out, bursts
        if rng.random() * ceiling > rate_at(t, duration_s, peak_rps, bursts):
            continue
        classes, weights = zip(*(mix(t / duration_s) if only is None else [(only, 1.0)]))
        cls = rng.choices(classes, weights)[0]
        out.append(TraceRequest(t, _lognormal(rng, cls.prompt_median, 0.5, 16, 8000),
                                _lognormal(rng, cls.output_median, 0.6, 8, 2000)))
