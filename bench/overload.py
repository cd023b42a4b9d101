"""Overload: goodput, 429 share and admitted TTFT from half to ten times capacity, against `disagg up`.

Starts `disagg up` (router + 1 prefill + 1 decode, the tiny generated checkpoint, NIXL when it is installed, else
shared storage; --spec for another), then:
1. capacity: streamed completions with Poisson arrivals at rising rates (x1.5 a step); the highest rate served
   (90% of the requests sent complete within the SLO) is the capacity, and the search stops after two steps in a
   row that are not served;
2. per multiple of it (default 0.5 1 2 5 10), --duration seconds of arrivals: goodput (requests completed within
   the SLO per second, counted as they complete within the steady part of the arrivals - see below), the share
   answered 429, the share of other errors, p50/p99 TTFT of the
   admitted requests (a 200 with a first token), and how long the workers took to read idle afterwards.

The SLO: TTFT <= --slo-ttft and time per output token after the first <= --slo-tpot, and the whole answer
(max_tokens tokens, no error event). A request still unanswered --grace seconds after the last arrival is given
up (the client disconnects) and counts as missed. Between steps the bench waits until every worker reads idle
(nothing running or waiting, KV usage 0).

Goodput is a sustained rate: the requests within the SLO that completed between --warm-up seconds after the first
arrival and the last arrival, per second of that window. Counted per second of arrivals instead (every request
sent in the window, whenever it completed), a short window above capacity scores what the servers finish after
it: a backlog that still meets a 2 s TTFT SLO is up to 2 s of capacity, a tenth of a 20 s window, so the peak
(the capacity search's best step) reads higher than any rate the servers sustain. That figure is printed too
("per arrivals s").

    python bench/overload.py [--gateway] [--duration 20] [--multiples 0.5 1 2 5 10] [--json out.json]

--gateway puts Envoy with `disagg epp` in front (`disagg up --gateway`) instead of the router. The "listen drops"
column is the kernel's count of connections dropped at a full accept queue during the step: a front door that
cannot accept as fast as clients connect, whose clients then wait seconds for their SYN to be retried.

The load generator shares the machine with the servers (on 2 cores a flood costs the servers CPU too). Not a test.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp
import httpx
import yaml

REPO = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "disagg.worker.cli"]
WORDS = "the history of the city begins with a small harbour and a market where fishermen sold fish".split()
IDLE_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")


@dataclass
class Outcome:
    status: int  # HTTP status; 0: no answer (connection error, given up)
    ttft: float | None = None  # seconds to the first token (admitted requests)
    tpot: float | None = None  # seconds per output token after the first
    complete: bool = False  # every token came and no error event
    done_at: float = float("inf")  # seconds from the first arrival to the answer's end (a whole 200)


@dataclass
class Step:
    rate: float  # offered requests per second: the arrival rate asked for
    offered: int  # requests sent (below rate x duration when the load generator could not keep up)
    goodput: float  # requests within the SLO completed per second of the steady window (module doc)
    shed: float  # share answered 429
    errors: float  # share of other failures (5xx, an SSE error event, no answer)
    ttft_p50: float
    ttft_p99: float  # of the admitted requests
    idle_after_s: float  # from the last answer until every worker reads idle
    foreign_cpu: float = 0.0  # cores other processes of the machine used meanwhile (a shared machine's noise)
    client_cpu: float = 0.0  # cores this load generator used itself while it offered the load (it shares them)
    duration: float = 0.0  # seconds of arrivals
    listen_drops: int = 0  # connections the kernel dropped meanwhile, its accept queues full (TcpExt ListenDrops)
    goodput_per_arrivals: float = 0.0  # requests within the SLO (whenever completed) per second of arrivals

    @property
    def sent_rate(self) -> float:
        return self.offered / self.duration if self.duration else float("nan")


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(int(q * len(values)), len(values) - 1)]


async def one_request(session: aiohttp.ClientSession, url: str, body: dict, max_tokens: int,
                      t0: float) -> Outcome:
    """(`t0`: perf_counter at the step's first arrival.)"""
    start = time.perf_counter()
    times: list[float] = []
    try:
        async with session.post(f"{url}/v1/completions", json=body) as r:
            if r.status != 200:
                await r.read()
                return Outcome(r.status)
            error, tokens = False, 0
            async for raw in r.content:  # line by line
                if not raw.startswith(b"data: {"):
                    continue
                chunk = json.loads(raw[6:])
                if "error" in chunk:
                    error = True
                elif chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                elif chunk["choices"] and chunk["choices"][0]["text"]:
                    times.append(time.perf_counter())
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return Outcome(0, times[0] - start if times else None)
    if not times:
        return Outcome(200)
    tpot = (times[-1] - times[0]) / max(tokens - 1, 1)
    return Outcome(200, times[0] - start, tpot, complete=not error and tokens == max_tokens,
                   done_at=time.perf_counter() - t0)


async def offer(url: str, rate: float, duration: float, args: argparse.Namespace, seed: int) -> list[Outcome]:
    """Poisson arrivals at `rate` for `duration` seconds; requests unanswered `grace` s later are given up.
    aiohttp's client (its C HTTP parser): the load generator shares the servers' cores, and at 10x httpx's took
    0.49 cores to send 89 req/s where this takes 0.15 to send 229 (2 cores, same session of measurements)."""
    rng = random.Random(seed)
    # idle connections closed by the client before any server would (uvicorn: 5 s), never written as one closes
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=2.0)
    timeout = aiohttp.ClientTimeout(total=duration + args.grace, sock_connect=10)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        tasks = []
        t0 = time.perf_counter()
        i, due = 0, 0.0  # the next arrival, in seconds after t0: a schedule, so a late wake-up sends what is due
        while due < duration:  # at once rather than stretching every gap after it
            prompt = " ".join(rng.choice(WORDS) for _ in range(args.prompt_words)) + f" {seed}-{i}"
            body = {"model": "tiny-llama", "prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0,
                    "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
            tasks.append(asyncio.ensure_future(one_request(session, url, body, args.max_tokens, t0)))
            i += 1
            due += rng.expovariate(rate)
            await asyncio.sleep(max(due - (time.perf_counter() - t0), 0))  # 0: what is due goes, answers are read
        done, pending = await asyncio.wait(tasks, timeout=args.grace)
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    return [t.result() if t in done else Outcome(0) for t in tasks]


def summarize(rate: float, duration: float, outcomes: list[Outcome], args: argparse.Namespace,
              idle_s: float) -> Step:
    n = len(outcomes)
    good = [o for o in outcomes if o.complete and o.ttft <= args.slo_ttft and o.tpot <= args.slo_tpot]
    warm = min(args.warm_up, duration / 2)
    steady = sum(warm <= o.done_at <= duration for o in good) / (duration - warm)
    admitted = [o.ttft for o in outcomes if o.status == 200 and o.ttft is not None]
    shed = sum(o.status == 429 for o in outcomes)
    errors = sum(not o.complete and o.status != 429 for o in outcomes)
    return Step(rate, n, steady, shed / max(n, 1), errors / max(n, 1), percentile(admitted, 0.5),
                percentile(admitted, 0.99), idle_s, duration=duration, goodput_per_arrivals=len(good) / duration)


def worker_urls(up_log: Path) -> list[str]:
    return list(dict(re.findall(r"(\S+)\s+ready\s+(http://\S+)", up_log.read_text())).values())


def idle(urls: list[str]) -> bool:
    for u in urls:
        text = httpx.get(f"{u}/metrics", timeout=10).text
        for line in text.splitlines():
            if line.startswith(IDLE_GAUGES) and float(line.rsplit(" ", 1)[1]) != 0:
                return False
    return True


def wait_idle(urls: list[str], timeout_s: float = 120) -> float:
    start = time.monotonic()
    while not idle(urls):
        if time.monotonic() - start > timeout_s:
            return float("inf")
        time.sleep(0.25)
    return time.monotonic() - start


# ---------------------------------------------------------------- the machine's other load
def _busy_jiffies() -> int:
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return sum(fields) - fields[3] - fields[4]  # all but idle and iowait


def _tree_jiffies(root: int) -> int:
    """utime + stime of `root` and its descendants (children that exited and were waited for included)."""
    total, stats = 0, {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        stats[int(stat.parent.name)] = (int(fields[1]), sum(int(x) for x in fields[11:15]))
    family = {root}
    for _ in range(4):  # bench -> disagg up -> workers (-> their helpers)
        family |= {pid for pid, (ppid, _) in stats.items() if ppid in family}
    for pid in family:
        total += stats.get(pid, (0, 0))[1]
    return total


class ForeignCpu:
    """Cores used by processes other than this bench and its `disagg up`, between two readings."""

    def __init__(self) -> None:
        self.hz = os.sysconf("SC_CLK_TCK")
        self._mark()

    def _mark(self) -> None:
        self.t, self.busy, self.ours = time.monotonic(), _busy_jiffies(), _tree_jiffies(os.getpid())

    def since_mark(self) -> float:
        t, busy, ours = time.monotonic(), _busy_jiffies(), _tree_jiffies(os.getpid())
        cores = max((busy - self.busy) - (ours - self.ours), 0) / self.hz / max(t - self.t, 1e-3)
        self.t, self.busy, self.ours = t, busy, ours
        return cores


def wait_quiet(max_foreign: float, timeout_s: float = 1800) -> None:
    """Until other processes used under `max_foreign` cores for 5 s in a row (a shared machine)."""
    cpu, start = ForeignCpu(), time.monotonic()
    while time.monotonic() - start < timeout_s:
        time.sleep(5)
        if cpu.since_mark() < max_foreign:
            return
    print(f"  (the machine stayed busy for {timeout_s:.0f} s; measuring anyway)", flush=True)


def listen_drops() -> int:
    """The network namespace's count of connection attempts dropped at a full accept queue (the front door's
    listener falling behind: the client's SYN is retried after 1, 3, 7 s... - seconds no server-side metric sees).
    Counts every listener of the machine; during a step, the front door's."""
    try:
        lines = Path("/proc/net/netstat").read_text().splitlines()
    except OSError:
        return 0
    for names, values in zip(lines[::2], lines[1::2]):
        if names.startswith("TcpExt:"):
            return int(dict(zip(names.split()[1:], values.split()[1:])).get("ListenDrops", 0))
    return 0


def measure(url: str, workers: list[str], rate: float, duration: float, args: argparse.Namespace,
            seed: int) -> Step:
    """One step; again (up to --tries times, the quietest kept) when other processes took more than twice
    --max-foreign-cpu meanwhile."""
    steps = []
    for _ in range(max(args.tries, 1)):
        if args.max_foreign_cpu:
            wait_quiet(args.max_foreign_cpu)
        cpu, client0, wall0, drops0 = ForeignCpu(), time.process_time(), time.monotonic(), listen_drops()
        outcomes = asyncio.run(offer(url, rate, duration, args, seed))
        client = (time.process_time() - client0) / (time.monotonic() - wall0)
        step = summarize(rate, duration, outcomes, args, wait_idle(workers))
        step.client_cpu = client
        step.listen_drops = listen_drops() - drops0
        step.foreign_cpu = cpu.since_mark()
        steps.append((step, outcomes))
        if not args.max_foreign_cpu or step.foreign_cpu <= 2 * args.max_foreign_cpu:
            break
        print(f"  ({rate:.2f} req/s: other processes took {step.foreign_cpu:.2f} cores; again)", flush=True)
    step, outcomes = min(steps, key=lambda so: so[0].foreign_cpu)
    print(f"  {rate:7.2f} req/s: goodput {step.goodput:6.2f}/s (per arrivals s {step.goodput_per_arrivals:6.2f})  429 {step.shed:5.1%}  errors {step.errors:5.1%}  "
          f"TTFT p50 {step.ttft_p50:6.3f} s p99 {step.ttft_p99:6.3f} s  idle after {step.idle_after_s:5.1f} s  "
          f"statuses {dict(collections.Counter(o.status for o in outcomes))}  sent {step.sent_rate:.1f} "
          f"req/s  load generator {step.client_cpu:.2f} cores  other processes {step.foreign_cpu:.2f} cores  "
          f"listen drops {step.listen_drops}",
          flush=True)
    return step


SERVED = 0.9  # a rate is served when this share of what was sent completes within the SLO


def find_capacity(url: str, workers: list[str], args: argparse.Namespace) -> tuple[float, list[Step]]:
    """The highest rate served (goodput >= SERVED x the rate sent), rising x1.5 a step until two steps in a row
    are not served. Not the rate of the best goodput: with admission control goodput stays near its best far
    past capacity (the surplus is refused), so that rate is already an overload."""
    steps: list[Step] = []
    rate, served, missed = args.start_rate, None, 0
    while missed < 2 and rate <= args.max_rate:
        step = measure(url, workers, rate, args.probe_duration, args, seed=len(steps))
        steps.append(step)
        if step.goodput >= SERVED * step.sent_rate:
            served, missed = step, 0
        else:
            missed += 1
        rate *= 1.5
    return (served or steps[0]).rate, steps


def write_spec(tmp: Path, args: argparse.Namespace) -> Path:
    if args.spec:
        return Path(args.spec)
    doc = yaml.safe_load((REPO / "examples" / "local.yaml").read_text())
    spec = doc["spec"]
    spec["decode"]["replicas"] = 1
    try:
        import nixl  # noqa: F401
    except ImportError:
        spec["kvTransfer"]["connector"] = "SharedStorageConnector"
    path = tmp / "overload.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def start(tmp: Path, spec: Path, gateway: bool = False, attempts: int = 3) -> tuple[subprocess.Popen, str, list[str]]:
    """`disagg up`, again on another port when one was taken meanwhile (a busy shared machine)."""
    from disagg.worker.local.process import free_port

    for attempt in range(attempts):
        port = free_port()
        log = tmp / f"up-{attempt}.out"
        cmd = [*CLI, "up", "-f", str(spec), "--port", str(port), "--log-dir", str(tmp / f"logs-{attempt}")]
        proc = subprocess.Popen(cmd + (["--gateway"] if gateway else []), stdout=log.open("w"),
                                stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while "serving" not in log.read_text() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        if "serving" in log.read_text():
            return proc, f"http://127.0.0.1:{port}", worker_urls(log)
        proc.kill()
        proc.wait()
    raise SystemExit(f"disagg up failed:\n{log.read_text()}")


def table(title: str, capacity: float, steps: list[tuple[float, Step]], search: list[Step]) -> str:
    """`search`: the capacity search's steps - the peak is the best goodput of any step measured."""
    peak = max(s.goodput for s in [*search, *(s for _, s in steps)]) or float("nan")
    lines = [title, f"capacity {capacity:.2f} req/s; peak goodput {peak:.2f}/s (any step, capacity search included)",
             "| load | offered req/s | sent req/s | goodput /s | of peak | per arrivals s | 429 | other errors "
             "| admitted TTFT p50 | p99 | idle after | load generator | other processes | listen drops |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for m, s in steps:
        lines.append(f"| {m:g}x | {s.rate:.2f} | {s.sent_rate:.2f} | {s.goodput:.2f} | {s.goodput / peak:.0%} | "
                     f"{s.goodput_per_arrivals:.2f} | "
                     f"{s.shed:.0%} | {s.errors:.0%} | {s.ttft_p50:.3f} s | {s.ttft_p99:.3f} s | "
                     f"{s.idle_after_s:.1f} s | {s.client_cpu:.2f} cores | {s.foreign_cpu:.2f} cores | "
                     f"{s.listen_drops} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--spec", help="a DisaggregatedInference YAML for `disagg up` (default: local.yaml, 1 decode)")
    p.add_argument("--gateway", action="store_true",
                   help="front the workers with `disagg up --gateway` (Envoy + `disagg epp`) instead of the router")
    p.add_argument("--url", help="measure this running router instead of starting `disagg up` (with --workers)")
    p.add_argument("--workers", nargs="*", default=[], help="with --url: the workers' URLs (idle checks)")
    p.add_argument("--multiples", type=float, nargs="+", default=[0.5, 1, 2, 5, 10])
    p.add_argument("--capacity", type=float, help="skip the capacity search: this many requests per second")
    p.add_argument("--duration", type=float, default=20.0, help="seconds of arrivals per multiple")
    p.add_argument("--probe-duration", type=float, default=12.0, help="seconds of arrivals per capacity step")
    p.add_argument("--start-rate", type=float, default=2.0)
    p.add_argument("--max-rate", type=float, default=400.0)
    p.add_argument("--warm-up", type=float, default=2.0,
                   help="seconds after the first arrival before completions count towards goodput")
    p.add_argument("--grace", type=float, default=30.0, help="seconds after the last arrival before giving up")
    p.add_argument("--prompt-words", type=int, default=96)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--slo-ttft", type=float, default=2.0, help="seconds")
    p.add_argument("--slo-tpot", type=float, default=0.25, help="seconds per output token after the first")
    p.add_argument("--label", default="", help="a title for the table")
    p.add_argument("--tries", type=int, default=3, help="tries per step on a busy machine (see --max-foreign-cpu)")
    p.add_argument("--max-foreign-cpu", type=float, default=0.3,
                   help="before each step, wait until other processes used less than this many cores for 5 s "
                        "(0: do not wait)")
    p.add_argument("--json", help="write the steps here")
    args = p.parse_args()
    if args.url and (args.gateway or args.spec):
        p.error("--url measures a running front door: --gateway and --spec only choose what `disagg up` starts")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # stopped: `disagg up` is stopped too (finally)
    with tempfile.TemporaryDirectory(prefix="overload-") as d:
        tmp = Path(d)
        proc = None
        if args.url:
            url, workers = args.url, args.workers
        else:
            proc, url, workers = start(tmp, write_spec(tmp, args), args.gateway)
        try:
            asyncio.run(offer(url, 2.0, 3.0, args, seed=999))  # warm-up
            wait_idle(workers)
            search: list[Step] = []
            if args.capacity:
                capacity = args.capacity
            else:
                print("capacity search:", flush=True)
                capacity, search = find_capacity(url, workers, args)
            print(f"capacity: {capacity:.2f} req/s; multiples:", flush=True)
            steps = [(m, measure(url, workers, m * capacity, args.duration, args, seed=100 + i))
                     for i, m in enumerate(args.multiples)]
        finally:
            if proc is not None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(120)
                except subprocess.TimeoutExpired:
                    proc.kill()
    print()
    slo = f"SLO: TTFT <= {args.slo_ttft:g} s, TPOT <= {args.slo_tpot:g} s, all {args.max_tokens} tokens"
    print(table(f"{args.label} {slo}".strip(), capacity, steps, search))
    if args.json:
        Path(args.json).write_text(json.dumps({"capacity": capacity, "slo": slo, "search": [asdict(s) for s in search],
                                               "steps": [{"multiple": m, **asdict(s)} for m, s in steps]}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
