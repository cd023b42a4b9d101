"""Admission checks (vLLM's input processor): a prompt becomes token ids, and what only the engine can check -
the vocabulary, max_model_len, the P/D hand-off against the connector, sampling settings against the model - is
checked before anything is queued. A bad request gets a ValueError naming what is wrong. Structured outputs are
compiled here: a grammar that does not compile is the request's fault too."""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from disagg.worker.engine.structured_output import GrammarCompiler
from disagg.worker.kv_transfer.base import KVConnectorBase
from disagg.worker.kv_transfer.handoff import Handoff
from disagg.worker.model.tokenizer import Tokenizer
from disagg.worker.sampling_params import SamplingParams


@dataclass(frozen=True)
class ProcessedInput:
    token_ids: list[int]  # the prompt
    handoff: Handoff | None  # the P/D hand-off, parsed
    delivered: tuple[int, ...]  # the first output tokens, chosen by the prefill engine (Request.forced_output_ids)


class InputProcessor:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int, max_model_len: int, eos_token_ids: frozenset[int],
                 handoff_fields: dict[str, type], connector: KVConnectorBase | None):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.handoff_fields = handoff_fields  # the connector's declared hand-off keys beyond the common ones
        self.connector = connector  # scheduler role: judges a hand-off it cannot act on
        self._grammars: GrammarCompiler | None = None  # built at the first structured-output request
        self._grammars_lock = threading.Lock()  # the server compiles on its request threads, not the engine's

    def process(self, prompt: str | list[int], sp: SamplingParams,
                kv_transfer_params: Handoff | dict[str, Any] | None) -> ProcessedInput:
        sp.validate()
        token_ids = self._token_ids(prompt)
        handoff = None
        if kv_transfer_params is not None:
            handoff = Handoff.parse(kv_transfer_params, self.handoff_fields)
            if self.connector is not None:
                self.connector.validate_kv_transfer_params(token_ids, handoff)
        self._check_sampling(sp, handoff)
        return ProcessedInput(token_ids, handoff, self._delivered_tokens(sp, handoff))

    def _token_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            token_ids = self.tokenizer.encode(prompt)
        else:
            token_ids = list(prompt)
            bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")
        if not token_ids:
            raise ValueError("prompt is empty")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(token_ids)} tokens; max_model_len is {self.max_model_len} "
                "(prompt plus at least one new token must fit)"
            )
        return token_ids

    def _check_sampling(self, sp: SamplingParams, handoff: Handoff | None) -> None:
        """What only the engine can check (vocabulary, grammar); compiles the structured output."""
        vocab = self.vocab_size
        bad = [t for t in [*sp.logit_bias, *sp.stop_token_ids] if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"logit_bias / stop_token_ids: token ids {bad[:5]} are outside the vocabulary "
                             f"[0, {vocab})")
        if sp.n > 1 and handoff is not None and handoff.is_prefill_hop:
            raise ValueError("n must be 1 on a prefill hop (do_remote_decode): the decode worker forks the choices")
        sp.eos_token_ids = self.eos_token_ids
        self.compile_structured_output(sp)

    def compile_structured_output(self, sp: SamplingParams) -> None:
        """Compile sp's structured output, unless done already (the server does it before the engine thread
        sees the request; xgrammar's compiler may be used from several threads)."""
        if sp.structured_output is None or sp.structured_output.compiled is not None:
            return
        with self._grammars_lock:
            if self._grammars is None:
                self._grammars = GrammarCompiler(self.tokenizer, self.vocab_size, sorted(self.eos_token_ids))
        sp.structured_output.compiled = self._grammars.compile(sp.structured_output)

    def _delivered_tokens(self, sp: SamplingParams, handoff: Handoff | None) -> tuple[int, ...]:
        """kv_transfer_params.delivered_token_ids: the first output tokens, which the prefill engine chose and a
        router already streamed to the client (its output_token_ids); this engine continues after them."""
        ids = handoff.delivered_token_ids if handoff is not None else ()
        if not ids:
            return ()
        vocab = self.vocab_size
        if not all(t < vocab for t in ids):
            raise ValueError(f"kv_transfer_params.delivered_token_ids must be a non-empty list of token ids in "
                             f"[0, {vocab}), got {list(ids)!r:.80}")
        if sp.n != 1:
            raise ValueError("kv_transfer_params.delivered_token_ids needs n == 1 (one choice was delivered)")
        if len(ids) > sp.max_tokens:
            raise ValueError(f"kv_transfer_params.delivered_token_ids has {len(ids)} tokens, more than max_tokens "
                             f"({sp.max_tokens})")
        return tuple(ids)
