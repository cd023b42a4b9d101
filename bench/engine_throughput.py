"""Generated tokens/s of LLM.generate vs transformers' generate on the same model and prompts.

Same random-weight Llama checkpoint (default 4 layers, hidden 512), same prompts of mixed lengths,
greedy, float32 on CPU, EOS ignored. Two workloads, each printed with both rates and the ratio:
  fixed:  every request generates --new-tokens (the issue's configuration);
  mixed:  each request wants between 8 and 2 x --new-tokens - 8 tokens (same mean). transformers'
          static batch runs until the longest request is done; only wanted tokens are counted.

    python bench/engine_throughput.py [--batch 32] [--new-tokens 64] [--layers 4] [--hidden 512]
"""
from __future__ import annotations

import argparse
import random
import shutil
import tempfile
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--min-prompt", type=int, default=16)
    ap.add_argument("--max-prompt", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()

    import transformers

    from disagg.worker import LLM, SamplingParams
    from disagg.worker.model import write_tiny_checkpoint

    torch.manual_seed(0)
    heads = args.hidden // 64
    tmp = tempfile.mkdtemp()
    write_tiny_checkpoint(tmp, hidden_size=args.hidden, num_layers=args.layers, num_heads=heads,
                          num_kv_heads=max(1, heads // 4), intermediate_size=args.hidden * 3)
    rng = random.Random(0)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp, torch_dtype=torch.float32).eval()
    vocab = hf.config.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(args.min_prompt, args.max_prompt))]
               for _ in range(args.batch)]
    llm = LLM(tmp, max_model_len=1024, max_num_seqs=args.batch, max_num_batched_tokens=8192,
              enable_prefix_caching=False)

    def run_hf(lengths: list[int]) -> float:
        width = max(len(p) for p in prompts)
        ids = torch.zeros(len(prompts), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):  # left padding, as decoder-only batched generate needs
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        n = max(lengths)  # one static batch: it runs until its longest request is done
        t = time.perf_counter()
        with torch.no_grad():
            out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                              do_sample=False, pad_token_id=0)
        elapsed = time.perf_counter() - t
        assert out.shape[1] - width == n
        return elapsed

    def run_ours(lengths: list[int]) -> float:
        params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in lengths]
        t = time.perf_counter()
        outs = llm.generate(prompts, params)
        elapsed = time.perf_counter() - t
        assert [len(o.outputs[0].token_ids) for o in outs] == lengths
        return elapsed

    print(f"model: {args.layers} layers, hidden {args.hidden}, {heads} heads; batch {args.batch}, "
          f"prompts {args.min_prompt}-{args.max_prompt} tokens, float32, {torch.get_num_threads()} threads")
    workloads = {
        "fixed": [args.new_tokens] * args.batch,
        "mixed": [rng.randint(8, 2 * args.new_tokens - 8) for _ in range(args.batch)],
    }
    run_ours(workloads["fixed"][:1] * args.batch)  # warm-up both
    run_hf([4] * args.batch)
    for name, lengths in workloads.items():
        wanted = sum(lengths)
        ours = min(run_ours(lengths) for _ in range(args.repeats))
        ref = min(run_hf(lengths) for _ in range(args.repeats))
        print(f"{name:6s} ({min(lengths)}-{max(lengths)} new tokens, {wanted} wanted): "
              f"transformers {wanted / ref:7.1f} tok/s ({ref:.2f} s) | disagg {wanted / ours:7.1f} tok/s "
              f"({ours:.2f} s) | ratio {ref / ours:.2f}x")
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
