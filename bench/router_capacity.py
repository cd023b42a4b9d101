"""What the front door costs: the latency our router adds, and what Envoy + our endpoint picker add, in front of
model servers that answer at once - and the highest request rate each keeps p99 added latency under 5 ms.

Each front door runs on one core (taskset -c FRONT_CORE; for the gateway, Envoy with --concurrency 1 and the
picker together on that core), the stub model servers and this load generator on the other. The stubs are an
Envoy answering every path at once (direct responses), two listeners, so the measured time is the front door's.
Open-loop Poisson arrivals at each --rates; each request's latency is measured from its scheduled send time
(queueing counts). Added latency = the front door's percentile minus the direct one's at the same rate.
Policy least-loaded in both (it reads the stubs' /metrics). Not a test.

    python bench/router_capacity.py [--rates 50 100 200 400 800] [--seconds 5]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from disagg.worker.gateway.envoy import envoy_argv, find_envoy
from disagg.worker.gateway.envoy_config import GatewayConfig, build_envoy_config, write_pool_endpoints
from disagg.worker.local.process import die_with_parent, free_port

CLI = [sys.executable, "-m", "disagg.worker.cli"]
ANSWER = json.dumps({"id": "cmpl-x", "object": "text_completion", "created": 0, "model": "stub",
                     "choices": [{"index": 0, "text": " ok", "finish_reason": "length"}],
                     "usage": {"prompt_tokens": 4, "completion_tokens": 1, "total_tokens": 5}})
BODY = json.dumps({"model": "stub", "prompt": "hello there", "max_tokens": 1}).encode()
P99_BUDGET_MS = 5.0


def stub_config(ports: list[int], admin: int) -> dict:
    """An Envoy whose listeners answer every request with ANSWER (and /metrics with nothing) at once."""
    def listener(port: int) -> dict:
        hcm = {"@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3."
                        "HttpConnectionManager", "stat_prefix": f"stub{port}",
               "route_config": {"virtual_hosts": [{"name": "stub", "domains": ["*"], "routes": [
                   {"match": {"prefix": "/metrics"}, "direct_response": {"status": 200, "body": {"inline_string": ""}}},
                   {"match": {"prefix": "/"}, "direct_response": {"status": 200, "body": {"inline_string": ANSWER}},
                    "response_headers_to_add": [{"header": {"key": "content-type", "value": "application/json"}}]},
               ]}]},
               # read the whole request first: answered before its body arrived, Envoy resets the connection
               "http_filters": [{"name": "envoy.filters.http.buffer", "typed_config": {
                   "@type": "type.googleapis.com/envoy.extensions.filters.http.buffer.v3.Buffer",
                   "max_request_bytes": 1 << 20}},
                   {"name": "envoy.filters.http.router", "typed_config": {
                       "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}]}
        return {"name": f"stub{port}", "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}},
                "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager",
                                                "typed_config": hcm}]}]}
    return {"static_resources": {"listeners": [listener(p) for p in ports]},
            "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin}}}}


class Procs:
    def __init__(self, log_dir: Path):
        self.log_dir, self.procs = log_dir, []

    def start(self, name: str, argv: list[str], core: int | None) -> None:
        if core is not None:
            argv = ["taskset", "-c", str(core), *argv]
        log = (self.log_dir / f"{name}.log").open("ab")
        self.procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent))

    def stop(self) -> None:
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
        self.procs = []


def wait_ok(url: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} not ready within {timeout_s} s")


async def _request(host: str, port: int, pool: asyncio.Queue, scheduled: float, out: list[float]) -> None:
    """One POST on a pooled keep-alive connection (HTTP/1.1, written by hand: httpx would cost more than the
    front door under test). Latency from the scheduled send time, in ms; a failure counts as infinite."""
    conn = await pool.get()
    try:
        if conn is None:
            conn = await asyncio.open_connection(host, port)
        reader, writer = conn
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(BODY), BODY))
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
        await reader.readexactly(length)
        ok = head.startswith(b"HTTP/1.1 200")
        out.append((time.perf_counter() - scheduled) * 1e3 if ok else float("inf"))
    except (OSError, asyncio.IncompleteReadError, StopIteration, ValueError):
        out.append(float("inf"))
        conn = None
    finally:
        pool.put_nowait(conn)


async def load(url: str, rate: float, seconds: float, connections: int = 128, seed: int = 1) -> list[float]:
    host, port = url.removeprefix("http://").split(":")
    pool: asyncio.Queue = asyncio.Queue()
    for _ in range(connections):
        pool.put_nowait(None)
    rng, out, tasks = random.Random(seed), [], []
    start = time.perf_counter()
    t = 0.0
    while t < seconds:
        t += rng.expovariate(rate)
        delay = start + t - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.ensure_future(_request(host, int(port), pool, start + t, out)))
    await asyncio.gather(*tasks)
    while not pool.empty():
        conn = pool.get_nowait()
        if conn is not None:
            conn[1].close()
    return out


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


def measure(url: str, rates: list[float], seconds: float) -> dict[float, tuple[float, float, float]]:
    """rate -> (p50 ms, p99 ms, share failed)"""
    asyncio.run(load(url, rates[0], 1.0))  # warm up connections and caches
    out = {}
    for rate in rates:
        lat = asyncio.run(load(url, rate, seconds))
        out[rate] = (pct(lat, 0.5), pct(lat, 0.99), sum(v == float("inf") for v in lat) / len(lat))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rates", type=float, nargs="+", default=[50, 100, 200, 400, 800, 1200])
    ap.add_argument("--seconds", type=float, default=5.0, help="per rate")
    ap.add_argument("--front-core", type=int, default=0, help="the core the front door runs on")
    ap.add_argument("--load-core", type=int, default=1, help="the core of the stubs and this load generator")
    args = ap.parse_args()
    os.sched_setaffinity(0, {args.load_core})
    log_dir = Path(tempfile.mkdtemp(prefix="router-capacity-"))
    procs = Procs(log_dir)
    results: dict[str, dict] = {}
    try:
        stub_ports, stub_admin = [free_port(), free_port()], free_port()
        (log_dir / "stub.json").write_text(json.dumps(stub_config(stub_ports, stub_admin)))
        procs.start("stub", envoy_argv(find_envoy(), str(log_dir / "stub.json"), concurrency=1), args.load_core)
        wait_ok(f"http://127.0.0.1:{stub_admin}/ready")
        stubs = [f"http://127.0.0.1:{p}" for p in stub_ports]
        results["direct"] = measure(stubs[0], args.rates, args.seconds)

        router_port = free_port()
        procs.start("router", [*CLI, "router", "--host", "127.0.0.1", "--port", str(router_port), "--decode", *stubs,
                               "--log-level", "WARNING"], args.front_core)
        wait_ok(f"http://127.0.0.1:{router_port}/ready")
        results["router"] = measure(f"http://127.0.0.1:{router_port}", args.rates, args.seconds)
        procs.procs[-1].terminate()
        procs.procs[-1].wait(30)

        grpc_port, http_port = free_port(), free_port()
        procs.start("epp", [*CLI, "epp", "--host", "127.0.0.1", "--grpc-port", str(grpc_port), "--health-port",
                            str(free_port()), "--metrics-port", str(http_port), "--decode", *stubs,
                            "--log-level", "WARNING"], args.front_core)
        wait_ok(f"http://127.0.0.1:{http_port}/ready")
        eds = log_dir / "pool" / "eds.json"
        eds.parent.mkdir()
        write_pool_endpoints(eds, [("127.0.0.1", p) for p in stub_ports])
        c = GatewayConfig("127.0.0.1", free_port(), "127.0.0.1", grpc_port, str(eds), free_port(), "FailClose")
        (log_dir / "gateway.json").write_text(json.dumps(build_envoy_config(c)))
        procs.start("gateway", envoy_argv(find_envoy(), str(log_dir / "gateway.json"), concurrency=1),
                    args.front_core)
        wait_ok(f"http://127.0.0.1:{c.admin_port}/ready")
        results["envoy+epp"] = measure(f"http://127.0.0.1:{c.listen_port}", args.rates, args.seconds)
    finally:
        procs.stop()
    report(results, args)
    return 0


def report(results: dict[str, dict], args: argparse.Namespace) -> None:
    direct = results["direct"]
    print(f"\nadded latency (ms) over the direct stub, front door on core {args.front_core}; {args.seconds:g} s per rate")
    print(f"{'rate/s':>7} {'direct p50/p99':>15} " + " ".join(f"{name + ' +p50/+p99 (fail)':>30}"
                                                            for name in results if name != "direct"))
    capacity = {}
    for rate in args.rates:
        d50, d99, _ = direct[rate]
        cells = []
        for name, res in results.items():
            if name == "direct":
                continue
            p50, p99, failed = res[rate]
            cells.append(f"{p50 - d50:>12.2f} / {p99 - d99:>7.2f} ({failed:.0%})")
            if p99 - d99 < P99_BUDGET_MS and failed == 0:
                capacity[name] = rate
        print(f"{rate:>7g} {d50:>6.2f} / {d99:>6.2f} " + " ".join(f"{c:>30}" for c in cells))
    print(f"\nhighest rate with p99 added < {P99_BUDGET_MS:g} ms and no failure: " +
          ", ".join(f"{name} {capacity.get(name, 0):g}/s" for name in results if name != "direct"))


if __name__ == "__main__":
    sys.exit(main())
