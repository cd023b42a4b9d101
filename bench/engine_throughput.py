"""Generated tokens/s of LLM.generate vs transformers' generate on the same model and prompts.

Same random-weight Llama checkpoint (default 4 layers, hidden 512), same prompts of mixed lengths,
greedy, fixed number of new tokens (EOS ignored), float32 on CPU. Prints both rates and the ratio.

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
    total_new = args.batch * args.new_tokens

    def run_hf() -> float:
        width = max(len(p) for p in prompts)
        ids = torch.zeros(len(prompts), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):  # left padding, as decoder-only batched generate needs
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        t = time.perf_counter()
        with torch.no_grad():
            out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=args.new_tokens,
                              min_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0)
        elapsed = time.perf_counter() - t
        assert out.shape[1] - width == args.new_tokens
        return elapsed

    llm = LLM(tmp, max_model_len=1024, max_num_seqs=args.batch, max_num_batched_tokens=8192,
              enable_prefix_caching=False)
    sp = SamplingParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True)

    def run_ours() -> float:
        t = time.perf_counter()
        outs = llm.generate(prompts, sp)
        elapsed = time.perf_counter() - t
        assert sum(len(o.outputs[0].token_ids) for o in outs) == total_new
        return elapsed

    run_ours()  # warm-up both
    run_hf()
    ours = min(run_ours() for _ in range(args.repeats))
    ref = min(run_hf() for _ in range(args.repeats))
    print(f"model: {args.layers} layers, hidden {args.hidden}, {heads} heads; batch {args.batch}, "
          f"prompts {args.min_prompt}-{args.max_prompt} tokens, {args.new_tokens} new tokens, "
          f"{torch.get_num_threads()} threads")
    print(f"transformers generate: {total_new / ref:8.1f} tok/s ({ref:.2f} s)")
    print(f"disagg LLM.generate:   {total_new / ours:8.1f} tok/s ({ours:.2f} s)")
    print(f"ratio (disagg / transformers): {ref / ours:.2f}x")
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
