"""`disagg generate`: offline generation with the engine (a quick check that a checkpoint works)."""
from __future__ import annotations

import argparse
import logging
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="checkpoint directory; omitted: generate the tiny demo checkpoint")
    p.add_argument("--prompt", action="append", required=True, help="prompt text (repeat for a batch)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--log-level", default="WARNING")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from disagg.worker import LLM, SamplingParams

    from disagg.worker.model.tiny import default_model_dir

    model = args.model or str(default_model_dir())
    try:
        sp = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed)
        llm = LLM(model, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len)
        outputs = llm.generate(args.prompt, sp)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for out in outputs:
        c = out.outputs[0]
        print(f"prompt: {out.prompt!r}\noutput: {c.text!r}\ntokens: {c.token_ids} ({c.finish_reason})")
    return 0
