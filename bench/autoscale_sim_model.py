"""The discrete-time queue model behind bench/autoscale_sim.py: prefill pods, one shared KV-transfer fabric, decode
pods; pods start after a delay and drain on scale-down. Per-request TTFT and ITL; pod-seconds from creation to
the end of draining. Pods export the workers' metrics (cumulative histograms) as PodSamples for the policies."""
from __future__ import annotations

import bisect
import heapq
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from autoscale_sim_capacity import PodCapacity
from autoscale_sim_trace import TraceRequest

from disagg.operator.autoscaling import samples as m
from disagg.operator.autoscaling.samples import PROMPT_TOKENS, Histogram, PodSample

TTFT_BUCKETS = (0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)


class SimHistogram:
    __slots__ = ("bounds", "counts", "sum", "count")

    def __init__(self, bounds: tuple[float, ...]):
        self.bounds, self.counts, self.sum, self.count = bounds, [0.0] * (len(bounds) + 1), 0.0, 0.0

    def observe(self, value: float, n: float = 1.0) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += n
        self.sum += value * n
        self.count += n

    def snapshot(self) -> Histogram:
        cum, acc = [], 0.0
        for le, c in zip((*self.bounds, math.inf), self.counts):
            acc += c
            cum.append((le, acc))
        return Histogram(tuple(cum), self.sum, self.count)


@dataclass(eq=False)
class Req:
    spec: TraceRequest
    ppod: PrefillPod | None = None
    dpod: DecodePod | None = None
    prefill_done: float = -1.0
    admitted: float = -1.0
    first_token: float = -1.0
    finished: float = -1.0
    itl: float = -1.0


@dataclass(eq=False)
class Pod:
    name: str
    created: float
    ready_at: float
    draining: bool = False
    ended: float | None = None
    ttft: SimHistogram = field(default_factory=lambda: SimHistogram(TTFT_BUCKETS))
    xfer: SimHistogram = field(default_factory=lambda: SimHistogram(TTFT_BUCKETS))


@dataclass(eq=False)
class PrefillPod(Pod):
    free_at: float = 0.0
    kv_used: int = 0  # prompt tokens held until decode pulls them
    sends: int = 0  # requests whose KV waits here to be pulled
    prompt_tokens: int = 0  # prefilled so far (the vllm:prompt_tokens counter)


@dataclass(eq=False)
class DecodePod(Pod):
    kv_reserved: int = 0
    loading: int = 0  # admitted, KV in flight
    progress: float = 0.0  # tokens each running request has gained since the pod started
    running: list = field(default_factory=list)  # heap of (progress at which it finishes, seq, Req)
    itl: SimHistogram = field(default_factory=lambda: SimHistogram(ITL_BUCKETS))

    def load(self) -> int:
        return len(self.running) + self.loading


Controller = Callable[["Simulation", float], dict[str, int]]


class Simulation:
    def __init__(self, cap: PodCapacity, trace: list[TraceRequest], fabric: Callable[[float], float],
                 initial: dict[str, int], dt: float = 0.2):
        self.cap, self.fabric, self.dt = cap, fabric, dt
        self.reqs = [Req(r) for r in trace]
        self.pods: dict[str, list[Pod]] = {"prefill": [], "decode": []}  # live pods (starting, serving, draining)
        self.ended: list[Pod] = []  # drained and gone
        self.prefill_queue: deque[Req] = deque()
        self.prefilled: list = []  # heap (prefill done, seq, Req)
        self.decode_wait: deque[Req] = deque()
        self.link_queue: deque[Req] = deque()
        self.link_free_at = 0.0
        self.landing: list = []  # heap (KV arrived, seq, Req)
        self.seq = 0
        for role, n in initial.items():
            for _ in range(n):
                self._add_pod(role, 0.0, ready=True)

    # ------------------------------------------------------------ pods
    def _add_pod(self, role: str, t: float, ready: bool = False) -> None:
        self.seq += 1
        ready_at = t if ready else t + self.cap.startup_s
        name = f"{role}-{self.seq}"
        pod = PrefillPod(name, t, ready_at, free_at=ready_at) if role == "prefill" else DecodePod(name, t, ready_at)
        self.pods[role].append(pod)

    def active(self, role: str) -> list[Pod]:
        return [p for p in self.pods[role] if not p.draining]

    def ready(self, role: str, t: float) -> list[Pod]:
        return [p for p in self.active(role) if p.ready_at <= t]

    def scale(self, role: str, desired: int, t: float) -> None:
        active = self.active(role)
        for _ in range(desired - len(active)):
            self._add_pod(role, t)
        if desired < len(active):  # starting pods first, then the least loaded (pod-deletion-cost)
            def load(p):
                busy = p.sends + (p.free_at > t) if isinstance(p, PrefillPod) else p.load()
                return (p.ready_at <= t, busy)
            for p in sorted(active, key=load)[:len(active) - desired]:
                p.draining = True

    def pod_seconds(self, t_end: float) -> float:
        live = [p for ps in self.pods.values() for p in ps]
        return sum((p.ended if p.ended is not None else t_end) - p.created for p in self.ended + live)

    # ------------------------------------------------------------ metrics the workers export
    def samples(self, t: float) -> dict[str, list[PodSample]]:
        out = {}
        for role in ("prefill", "decode"):
            pods = self.ready(role, t)
            queue = self.prefill_queue if role == "prefill" else self.decode_wait
            share = 1 / max(1, len(pods))
            tokens = sum(r.spec.prompt for r in queue) * share if role == "prefill" else 0.0
            out[role] = [self._sample(p, role, t, len(queue) * share, tokens) for p in pods]
        return out

    def _sample(self, p: Pod, role: str, t: float, waiting: float, waiting_tokens: float) -> PodSample:
        hists = {m.TTFT: p.ttft.snapshot(), m.XFER_TIME: p.xfer.snapshot()}
        if isinstance(p, PrefillPod):
            values = {m.NUM_REQUESTS_WAITING: waiting, m.NUM_REQUESTS_RUNNING: float(p.free_at > t),
                      m.KV_CACHE_USAGE: p.kv_used / self.cap.prefill_kv_tokens, m.PENDING_SENDS: p.sends,
                      m.WAITING_PROMPT_TOKENS: waiting_tokens, PROMPT_TOKENS: p.prompt_tokens}
        else:
            values = {m.NUM_REQUESTS_WAITING: waiting, m.NUM_REQUESTS_RUNNING: len(p.running),
                      m.KV_CACHE_USAGE: p.kv_reserved / self.cap.decode_kv_tokens, m.PENDING_LOADS: p.loading}
            hists[m.ITL] = p.itl.snapshot()
        return PodSample(p.name, role, t, values, hists)

    # ------------------------------------------------------------ one time step
    def step(self, t: float) -> None:
        end = t + self.dt
        self._prefill(t, end)
        while self.prefilled and self.prefilled[0][0] < end:
            self.decode_wait.append(heapq.heappop(self.prefilled)[2])
        self._admit(t)
        self._transfer(t, end)
        self._land(end)
        self._decode(t)
        for role, ps in self.pods.items():
            gone = [p for p in ps if p.draining and self._idle(p, t)]
            for p in gone:
                p.ended = t
                ps.remove(p)
                self.ended.append(p)

    def _idle(self, p: Pod, t: float) -> bool:
        if p.ready_at > t:  # still starting: cancelled at once
            return True
        if isinstance(p, PrefillPod):
            return p.sends == 0 and p.free_at <= t
        return p.load() == 0

    def _prefill(self, t: float, end: float) -> None:
        cap = self.cap
        for p in self.ready("prefill", t):
            while self.prefill_queue and p.free_at < end:
                r = self.prefill_queue[0]
                if p.kv_used + r.spec.prompt > cap.prefill_kv_tokens:
                    break  # unsent KV fills this pod: back-pressure
                self.prefill_queue.popleft()
                start = max(p.free_at, r.spec.arrival, t)
                p.free_at = r.prefill_done = start + cap.prefill_s(r.spec.prompt)
                p.kv_used += r.spec.prompt
                p.prompt_tokens += r.spec.prompt
                p.sends += 1
                r.ppod = p
                p.ttft.observe(r.prefill_done - r.spec.arrival)
                self.seq += 1
                heapq.heappush(self.prefilled, (r.prefill_done, self.seq, r))

    def _admit(self, t: float) -> None:
        cap, pods = self.cap, self.ready("decode", t)
        while self.decode_wait and pods:
            r = self.decode_wait[0]
            need = r.spec.prompt + r.spec.output
            p = min(pods, key=DecodePod.load)
            if p.load() >= cap.decode_max_seqs or p.kv_reserved + need > cap.decode_kv_tokens:
                p = min(pods, key=lambda q: q.kv_reserved)
                if p.load() >= cap.decode_max_seqs or p.kv_reserved + need > cap.decode_kv_tokens:
                    return
            self.decode_wait.popleft()
            p.kv_reserved += need
            p.loading += 1
            r.dpod, r.admitted = p, max(t, r.prefill_done)
            self.link_queue.append(r)

    def _transfer(self, t: float, end: float) -> None:
        bw = self.fabric(t)
        while self.link_queue and self.link_free_at < end:
            r = self.link_queue.popleft()
            start = max(self.link_free_at, r.admitted)
            self.link_free_at = start + r.spec.prompt / bw
            done = self.link_free_at + self.cap.xfer_fixed_s
            r.dpod.xfer.observe(done - r.admitted)
            self.seq += 1
            heapq.heappush(self.landing, (done, self.seq, r))

    def _land(self, end: float) -> None:
        while self.landing and self.landing[0][0] < end:
            done, _, r = heapq.heappop(self.landing)
            r.ppod.kv_used -= r.spec.prompt
            r.ppod.sends -= 1
            p = r.dpod
            p.loading -= 1
            r.first_token = done + self.cap.step_s(len(p.running) + 1)
            p.ttft.observe(r.first_token - r.spec.arrival)
            self.seq += 1
            heapq.heappush(p.running, (p.progress + r.spec.output, self.seq, r))

    def _decode(self, t: float) -> None:
        for p in self.pods["decode"]:
            if not p.running:
                continue
            step = self.cap.step_s(len(p.running))
            gain = self.dt / step
            before = p.progress
            p.progress += gain
            p.itl.observe(step, gain * len(p.running))  # per token as produced, as the worker does
            while p.running and p.running[0][0] <= p.progress:
                target, _, r = heapq.heappop(p.running)
                r.finished = max(r.first_token, t + self.dt * (target - before) / gain)
                r.itl = (r.finished - r.first_token) / max(1, r.spec.output - 1)
                p.kv_reserved -= r.spec.prompt + r.spec.output

    # ------------------------------------------------------------ the whole trace
    def run(self, controller: Controller, interval: float, duration: float, drain_s: float = 600.0) -> float:
        """Step to the trace's end plus up to drain_s for the tail; returns the end time."""
        i, n, t, next_decision = 0, len(self.reqs), 0.0, interval
        while t < duration or (t < duration + drain_s and any(r.finished < 0 for r in self.reqs[-200:])):
            while i < n and self.reqs[i].spec.arrival < t + self.dt:
                self.prefill_queue.append(self.reqs[i])
                i += 1
            self.step(t)
            t += self.dt
            if t >= next_decision:
                next_decision += interval
                for role, desired in controller(self, t).items():
                    self.scale(role, desired, t)
        return t
