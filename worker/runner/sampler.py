"""Token sampling from the last-position logits of each request (greedy, temperature, top-k, top-p)."""
from __future__ import annotations

import torch

from disagg.worker.engine.sampling_params import SamplingParams


def sample(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> list[int]:
    """logits: (B, vocab) float32. One generator per row (None = torch's global one)."""
    greedy_ids = logits.argmax(dim=-1).tolist()
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if not rows:
        return greedy_ids
    idx = torch.tensor(rows, device=logits.device)
    sub = logits.index_select(0, idx)
    temps = torch.tensor([params[i].temperature for i in rows], device=logits.device, dtype=sub.dtype)
    sub = sub / temps.unsqueeze(1)
    sub = _apply_top_k_top_p(sub, [params[i].top_k for i in rows], [params[i].top_p for i in rows])
    probs = torch.softmax(sub, dim=-1)
    out = list(greedy_ids)
    for j, i in enumerate(rows):
        out[i] = int(torch.multinomial(probs[j], 1, generator=generators[i]).item())
    return out


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
