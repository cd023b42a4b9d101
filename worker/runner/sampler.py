"""Token sampling from the last-position logits of each request: logit processors (penalties, logit_bias,
grammar masks), then greedy or temperature / min-p / top-k / top-p sampling, plus logprobs of the raw logits.

Every processor is a tensor op over the rows that use it; a batch of plain requests pays one `any()` per
processor and nothing else."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from disagg.worker.outputs import TokenLogprobs
from disagg.worker.sampling_params import SamplingParams
from disagg.worker.runner.grammar_mask import advance_matchers, apply_grammar_masks
from disagg.worker.runner.logprobs import token_logprobs
from disagg.worker.runner.penalties import apply_logit_bias, apply_min_tokens, apply_penalties


@dataclass
class SamplingBatch:
    """Per-row inputs besides the logits (rows in batch order)."""

    params: list[SamplingParams]
    generators: list[torch.Generator | None]
    token_ids: list[list[int]] = field(default_factory=list)  # prompt + output so far (penalties)
    num_prompt_tokens: list[int] = field(default_factory=list)
    matchers: list[Any] = field(default_factory=list)  # a grammar matcher or None per row
    req_ids: list[str] = field(default_factory=list)
    forced: list[int | None] = field(default_factory=list)  # a row's token, chosen elsewhere (P/D), or None


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> list[int]:
    """logits: (B, vocab) float32. One generator per row (None = torch's global one)."""
    return sample_batch(logits, SamplingBatch(params, generators))[0]


def sample_batch(logits: torch.Tensor, batch: SamplingBatch) -> tuple[list[int], list[TokenLogprobs | None]]:
    params = batch.params
    lp_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    raw = logits.index_select(0, torch.tensor(lp_rows, device=logits.device)) if lp_rows else None
    apply_logit_bias(logits, params)  # bias and min_tokens before the penalties, in vLLM's order
    if batch.token_ids:
        apply_min_tokens(logits, params, batch.token_ids, batch.num_prompt_tokens)
        apply_penalties(logits, params, batch.token_ids, batch.num_prompt_tokens)
    if batch.matchers:
        apply_grammar_masks(logits, batch.matchers)
    # a forced row still draws, so that its generator advances as it would have choosing the token itself
    token_ids = _choose(logits, params, batch.generators)
    if batch.forced:
        token_ids = [t if f is None else f for t, f in zip(token_ids, batch.forced)]
    if batch.matchers:
        advance_matchers(batch.matchers, token_ids, batch.req_ids or [""] * len(token_ids))
    logprobs: list[TokenLogprobs | None] = [None] * len(params)
    if raw is not None:
        entries = token_logprobs(raw, [token_ids[i] for i in lp_rows], [params[i].logprobs for i in lp_rows])
        for i, entry in zip(lp_rows, entries):
            logprobs[i] = entry
    return token_ids, logprobs


def _choose(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> list[int]:
    greedy_ids = logits.argmax(dim=-1).tolist()
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if not rows:
        return greedy_ids
    idx = torch.tensor(rows, device=logits.device)
    sub = logits.index_select(0, idx)
    temps = torch.tensor([params[i].temperature for i in rows], device=logits.device, dtype=sub.dtype)
    sub = sub / temps.unsqueeze(1)
    sub = _apply_min_p(sub, [params[i].min_p for i in rows])
    sub = _apply_top_k_top_p(sub, [params[i].top_k for i in rows], [params[i].top_p for i in rows])
    probs = torch.softmax(sub, dim=-1)
    out = list(greedy_ids)
    for j, i in enumerate(rows):
        out[i] = int(torch.multinomial(probs[j], 1, generator=generators[i]).item())
    return out


def _apply_min_p(logits: torch.Tensor, min_p: list[float]) -> torch.Tensor:
    """Mask tokens whose probability is below min_p x the row's top probability. logits: (B, V)."""
    if not any(min_p):
        return logits
    probs = torch.softmax(logits, dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * torch.tensor(min_p, device=logits.device).unsqueeze(1)
    return logits.masked_fill(probs < threshold, float("-inf"))


def _apply_top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Mask logits outside each row's top-k and nucleus (top-p) with -inf. logits: (B, V)."""
    if all(k <= 0 for k in top_k) and all(p >= 1.0 for p in top_p):
        return logits
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    ks = torch.tensor([k if k > 0 else vocab for k in top_k], device=logits.device)
    ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
    mask = ranks >= ks.unsqueeze(1)  # (B, V) outside top-k
    probs = torch.softmax(sorted_logits.masked_fill(mask, float("-inf")), dim=-1)
    cum = probs.cumsum(dim=-1) - probs  # mass strictly before each token
    ps = torch.tensor(top_p, device=logits.device, dtype=probs.dtype).unsqueeze(1)
    mask |= cum >= ps  # the first token is always kept (cum = 0)
    sorted_logits = sorted_logits.masked_fill(mask, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, sorted_idx, sorted_logits)
