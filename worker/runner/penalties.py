"""Logit processors over the whole batch (tensor ops, rows that ask only): repetition / presence / frequency
penalties (vLLM's definitions) and logit_bias. Each returns quickly when no row in the batch uses it."""
from __future__ import annotations

import torch

from disagg.worker.sampling_params import SamplingParams


def token_counts(lists: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """(len(lists), vocab) occurrence counts: one accumulating index_put over all rows' tokens."""
    counts = torch.zeros(len(lists), vocab, device=device)
    rows = [i for i, t in enumerate(lists) for _ in t]
    if rows:
        cols = torch.tensor([tok for t in lists for tok in t], device=device)
        counts.index_put_((torch.tensor(rows, device=device), cols), torch.ones(len(rows), device=device),
                          accumulate=True)
    return counts


def apply_penalties(logits: torch.Tensor, params: list[SamplingParams], token_ids: list[list[int]],
                    num_prompt: list[int]) -> None:
    """In place. repetition_penalty over prompt + output tokens; presence and frequency over output tokens."""
    rows = [i for i, p in enumerate(params) if p.has_penalties]
    if not rows:
        return
    dev, vocab = logits.device, logits.shape[-1]
    idx = torch.tensor(rows, device=dev)
    sub = logits.index_select(0, idx)
    out_counts = token_counts([token_ids[i][num_prompt[i]:] for i in rows], vocab, dev)
    seen = token_counts([token_ids[i][: num_prompt[i]] for i in rows], vocab, dev).gt(0) | out_counts.gt(0)

    def column(name: str) -> torch.Tensor:
        return torch.tensor([getattr(params[i], name) for i in rows], device=dev, dtype=sub.dtype).unsqueeze(1)

    rep = column("repetition_penalty")
    sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    sub = sub - column("frequency_penalty") * out_counts - column("presence_penalty") * out_counts.gt(0)
    logits.index_copy_(0, idx, sub)


def apply_logit_bias(logits: torch.Tensor, params: list[SamplingParams]) -> None:
    """In place: one index_put over every (row, token) bias in the batch."""
    if not any(p.logit_bias for p in params):
        return
    rows, cols, vals = [], [], []
    for i, p in enumerate(params):
        for token_id, bias in p.logit_bias.items():
            rows.append(i)
            cols.append(token_id)
            vals.append(bias)
    dev = logits.device
    logits.index_put_((torch.tensor(rows, device=dev), torch.tensor(cols, device=dev)),
                      torch.tensor(vals, device=dev, dtype=logits.dtype), accumulate=True)


def apply_min_tokens(logits: torch.Tensor, params: list[SamplingParams], token_ids: list[list[int]],
                     num_prompt: list[int]) -> None:
    """In place: EOS and stop_token_ids get -inf while a row has fewer than min_tokens outputs."""
    if not any(p.min_tokens for p in params):
        return
    rows, cols = [], []
    for i, p in enumerate(params):
        if p.min_tokens and len(token_ids[i]) - num_prompt[i] < p.min_tokens:
            stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(p.eos_token_ids))
            rows.extend([i] * len(stops))
            cols.extend(stops)
    if rows:
        dev = logits.device
        logits[torch.tensor(rows, device=dev), torch.tensor(cols, device=dev)] = float("-inf")
