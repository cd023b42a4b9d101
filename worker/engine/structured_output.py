"""Structured outputs (JSON object / JSON schema / regex / choice / EBNF grammar) with xgrammar.

xgrammar was picked by measurement (bench/grammar_libraries.py, this 2-core CPU, tiny tokenizer): per-token
mask 8 us vs llguidance 42 us and outlines-core 19 us, compile 2.3 ms (outlines-core 2.3 ms; llguidance
compiles lazily, 0.3 ms up front); it also has a built-in JSON grammar for json_object and EBNF for choices.

A grammar is compiled before the engine thread sees its request (the server does it on its request threads,
server/admission.py; LLM.generate at add_request): a bad schema is the request's fault (ValueError -> 400),
and a slow compile never holds an engine step. The runner makes
one matcher per request from the compiled grammar (runner/grammar_mask.new_matcher) and replays
already-generated tokens into it (after a preemption), so the grammar state follows the sequence wherever its
tokens are computed.
"""
from __future__ import annotations

import json
from typing import Any

from disagg.worker.sampling_params import StructuredOutputSpec

# compact JSON (no free whitespace): a weak or random model would otherwise emit whitespace for ever
SEPARATORS = (", ", ": ")


def _vocab_type(tokenizer_json: dict[str, Any]) -> Any:
    import xgrammar as xgr

    decoder = json.dumps(tokenizer_json.get("decoder") or {})
    if '"ByteLevel"' in decoder:
        return xgr.VocabType.BYTE_LEVEL
    if '"ByteFallback"' in decoder:
        return xgr.VocabType.BYTE_FALLBACK
    return xgr.VocabType.RAW


class GrammarCompiler:
    """One per engine: the tokenizer's vocabulary as xgrammar sees it, and a cache of compiled grammars."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]):
        import xgrammar as xgr

        hf = tokenizer.hf_tokenizer
        encoded = [hf.id_to_token(i) or "" for i in range(min(hf.get_vocab_size(), vocab_size))]
        info = xgr.TokenizerInfo(encoded, _vocab_type(json.loads(hf.to_str())), vocab_size=vocab_size,
                                 stop_token_ids=sorted(stop_token_ids))
        self._compiler = xgr.GrammarCompiler(info)

    def compile(self, spec: StructuredOutputSpec) -> Any:
        kind = spec.kind()
        try:
            if kind == "json":
                schema = spec.json if isinstance(spec.json, str) else json.dumps(spec.json)
                return self._compiler.compile_json_schema(schema, any_whitespace=False, separators=SEPARATORS)
            if kind == "json_object":  # any JSON object (xgrammar's builtin JSON grammar also allows arrays)
                return self._compiler.compile_json_schema('{"type": "object"}', any_whitespace=False,
                                                          separators=SEPARATORS)
            if kind == "regex":
                return self._compiler.compile_regex(spec.regex)
            if kind == "choice":
                if not spec.choice or not all(isinstance(c, str) and c for c in spec.choice):
                    raise ValueError("choice must be a non-empty list of non-empty strings")
                return self._compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c) for c in spec.choice))
            return self._compiler.compile_grammar(spec.grammar)
        except ValueError:
            raise
        except Exception as e:  # noqa: BLE001 - xgrammar's parse errors are RuntimeErrors: the request's fault
            raise ValueError(f"structured output ({kind}) cannot be compiled: {e}") from None
