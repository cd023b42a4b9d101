"""Grammar libraries for structured outputs, measured on this machine: xgrammar, llguidance, outlines-core.

For a JSON schema (and the generic JSON grammar where the library has one), on the tiny checkpoint's
tokenizer (or --model DIR): compile time, then the per-token cost of computing the allowed-token mask
and advancing the matcher along a valid JSON document, tokenized. Prints ms per compile and us per token.

    python bench/grammar_libraries.py [--model DIR] [--repeats 5]
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}, "maxItems": 4},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
    "additionalProperties": False,
}
DOC = json.dumps({"name": "the quick fox", "age": 42, "tags": ["a", "c"], "ok": True}, separators=(",", ":"))


def timed(fn, repeats: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), out


def bench_xgrammar(hf_tok, vocab: int, ids: list[int], repeats: int) -> dict[str, float]:
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(hf_tok, vocab_size=vocab)
    compile_s, compiled = timed(lambda: xgr.GrammarCompiler(info, cache_enabled=False).compile_json_schema(
        json.dumps(SCHEMA), any_whitespace=False, separators=(",", ":")), repeats)
    mask = xgr.allocate_token_bitmask(1, vocab)
    logits = torch.zeros(1, vocab)

    def walk() -> None:
        m = xgr.GrammarMatcher(compiled)
        for t in ids:
            m.fill_next_token_bitmask(mask, 0)
            xgr.apply_token_bitmask_inplace(logits, mask)
            assert m.accept_token(t), t
    walk_s, _ = timed(walk, repeats)
    return {"compile_ms": compile_s * 1e3, "us_per_token": walk_s / len(ids) * 1e6}


def bench_llguidance(hf_tok, vocab: int, ids: list[int], repeats: int) -> dict[str, float]:
    import llguidance
    import llguidance.hf
    import llguidance.torch as lt

    lltok = llguidance.hf.from_tokenizer(hf_tok, n_vocab=vocab)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        json.dumps(SCHEMA), defaults={"whitespace_flexible": False})
    compile_s, _ = timed(lambda: llguidance.LLMatcher(lltok, grammar), repeats)
    mask = lt.allocate_token_bitmask(1, vocab)
    logits = torch.zeros(1, vocab)

    def walk() -> None:
        m = llguidance.LLMatcher(lltok, grammar)
        for t in ids:
            lt.fill_next_token_bitmask(m, mask, 0)
            lt.apply_token_bitmask_inplace(logits, mask)
            assert m.consume_token(t), (t, m.get_error())
    walk_s, _ = timed(walk, repeats)
    return {"compile_ms": compile_s * 1e3, "us_per_token (incl. matcher creation)": walk_s / len(ids) * 1e6}


def bench_outlines(hf_tok, vocab: int, ids: list[int], repeats: int) -> dict[str, float]:
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    eos = hf_tok.eos_token_id
    table: dict[str, list[int]] = {}
    for tid in range(len(hf_tok)):
        if tid == eos:
            continue
        text = hf_tok.convert_ids_to_tokens(tid)
        table.setdefault(text, []).append(tid)
    voc = Vocabulary(eos, table)
    regex = build_regex_from_schema(json.dumps(SCHEMA))
    compile_s, index = timed(lambda: Index(regex, voc), repeats)
    logits = torch.zeros(1, vocab)

    def walk() -> None:
        g = Guide(index)
        for t in ids:
            allowed = torch.tensor(g.get_tokens())
            mask = torch.full((vocab,), float("-inf"))
            mask[allowed] = 0
            logits.add_(mask)
            g.advance(t)
    walk_s, _ = timed(walk, repeats)
    return {"compile_ms": compile_s * 1e3, "us_per_token": walk_s / len(ids) * 1e6}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="a checkpoint directory (default: the tiny checkpoint)")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    from transformers import PreTrainedTokenizerFast

    model = args.model
    if model is None:
        from disagg.worker.model import write_tiny_checkpoint
        model = tempfile.mkdtemp()
        write_tiny_checkpoint(model)
    hf_tok = PreTrainedTokenizerFast(tokenizer_file=f"{model}/tokenizer.json", eos_token="</s>")
    vocab = json.load(open(f"{model}/config.json"))["vocab_size"]
    ids = hf_tok.encode(DOC, add_special_tokens=False)
    print(f"tokenizer: {len(hf_tok)} tokens (model vocab {vocab}); document: {len(ids)} tokens; "
          f"{torch.get_num_threads()} threads; median of {args.repeats}")
    for name, fn in (("xgrammar", bench_xgrammar), ("llguidance", bench_llguidance),
                     ("outlines-core", bench_outlines)):
        try:
            result = fn(hf_tok, vocab, ids, args.repeats)
        except Exception as e:  # noqa: BLE001 - a library that cannot do it is a result too
            print(f"{name:14s} failed: {type(e).__name__}: {e}")
            continue
        print(f"{name:14s} " + "  ".join(f"{k} {v:9.2f}" for k, v in result.items()))


if __name__ == "__main__":
    main()
