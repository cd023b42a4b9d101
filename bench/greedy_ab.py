"""Plain greedy throughput of LLM.generate, this checkout vs a baseline checkout, interleaved in one session.

Each round runs the same workload (engine_throughput.py's model and prompts: random-weight Llama, mixed prompt
lengths, greedy, EOS ignored) once per tree, in fresh processes, alternating, so machine load drifts hit both
alike. Prints per-round tok/s and the median ratio head/base. The baseline is a directory holding a `disagg`
package tree of the other commit, e.g.:

    mkdir -p /tmp/base/disagg && git archive BASE worker operator | tar -x -C /tmp/base/disagg \\
        && touch /tmp/base/disagg/__init__.py
    python bench/greedy_ab.py --base /tmp/base [--rounds 5] [--batch 16] [--new-tokens 32]
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

RUN = r"""
import random, sys, tempfile, time, torch
from disagg.worker import LLM, SamplingParams
from disagg.worker.model import write_tiny_checkpoint
batch, new, layers, hidden, repeats = map(int, sys.argv[1:6])
torch.manual_seed(0)
heads = hidden // 64
tmp = tempfile.mkdtemp()
write_tiny_checkpoint(tmp, hidden_size=hidden, num_layers=layers, num_heads=heads, num_kv_heads=max(1, heads // 4),
                      intermediate_size=hidden * 3)
rng = random.Random(0)
prompts = [[rng.randrange(3, 700) for _ in range(rng.randint(16, 256))] for _ in range(batch)]
llm = LLM(tmp, max_model_len=1024, max_num_seqs=batch, max_num_batched_tokens=8192, enable_prefix_caching=False)
params = [SamplingParams(max_tokens=new, temperature=0, ignore_eos=True) for _ in prompts]
llm.generate(prompts, [SamplingParams(max_tokens=4, temperature=0, ignore_eos=True) for _ in prompts])
best = min((lambda t: (llm.generate(prompts, params), time.perf_counter() - t)[1])(time.perf_counter())
           for _ in range(repeats))
print(batch * new / best)
"""


def one(tree: str | None, args: argparse.Namespace) -> float:
    env = dict(os.environ)
    if tree:
        env["PYTHONPATH"] = tree
    else:
        env.pop("PYTHONPATH", None)
    out = subprocess.run([sys.executable, "-c", RUN, str(args.batch), str(args.new_tokens), str(args.layers),
                          str(args.hidden), str(args.repeats)], env=env, check=True, capture_output=True, text=True)
    return float(out.stdout.strip().splitlines()[-1])


def sampler_only(base: str, batch: int, vocab: int, rounds: int) -> None:
    """In one process: the baseline's sample() vs this checkout's on plain greedy rows, interleaved call by
    call (robust to machine load), on (batch, vocab) logits."""
    import importlib.util
    import time

    import torch

    from disagg.worker.sampling_params import SamplingParams
    from disagg.worker.runner.sampler import SamplingBatch, sample_batch

    spec = importlib.util.spec_from_file_location("base_sampler", f"{base}/disagg/worker/runner/sampler.py")
    old = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(old)
    params = [SamplingParams(max_tokens=64, temperature=0, ignore_eos=True) for _ in range(batch)]
    token_ids = [list(range(200)) for _ in range(batch)]
    logits = torch.randn(batch, vocab)
    t_old = t_new = 0.0
    for _ in range(rounds):
        t = time.perf_counter()
        old.sample(logits.clone(), params, [None] * batch)
        t_old += time.perf_counter() - t
        t = time.perf_counter()
        sample_batch(logits.clone(), SamplingBatch(params, [None] * batch, token_ids, [100] * batch, [],
                                                   [str(i) for i in range(batch)]))
        t_new += time.perf_counter() - t
    print(f"sampler, {batch} greedy rows x {vocab} vocab, {rounds} calls each: base {t_old / rounds * 1e6:.0f} us | "
          f"head {t_new / rounds * 1e6:.0f} us per call | head/base time {t_new / t_old:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", required=True, help="directory with the baseline's disagg package tree")
    ap.add_argument("--sampler-only", action="store_true", help="time only the sampler, in one process")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    if args.sampler_only:
        sampler_only(args.base, args.batch, 32000, 500)
        return
    ratios = []
    for r in range(args.rounds):
        base, head = one(args.base, args), one(None, args)
        ratios.append(head / base)
        print(f"round {r + 1}: base {base:7.1f} tok/s | head {head:7.1f} tok/s | head/base {head / base:.3f}",
              flush=True)
    print(f"median head/base over {args.rounds} rounds: {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
