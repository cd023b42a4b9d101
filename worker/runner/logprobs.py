"""Log-probabilities for the OpenAI `logprobs` / `prompt_logprobs` fields: log-softmax of the model's raw
logits (before penalties, bias, temperature or grammar masks, as vLLM's default raw_logprobs mode)."""
from __future__ import annotations

import torch

from disagg.worker.outputs import TokenLogprobs


def token_logprobs(logits: torch.Tensor, token_ids: list[int], num_top: list[int]) -> list[TokenLogprobs]:
    """logits: (R, V) raw; one entry per row: the given token's logprob and rank, and the row's top-k."""
    if not token_ids:
        return []
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen_t = torch.tensor(token_ids, device=lp.device).unsqueeze(1)
    chosen = lp.gather(1, chosen_t)
    ranks = (lp > chosen).sum(dim=1).add_(1).tolist()
    k = max(num_top)
    top_vals, top_ids = lp.topk(k, dim=-1) if k else (lp[:, :0], chosen_t[:, :0])
    top_vals, top_ids, chosen = top_vals.tolist(), top_ids.tolist(), chosen.squeeze(1).tolist()
    return [TokenLogprobs(t, chosen[r], ranks[r], list(zip(top_ids[r][: num_top[r]], top_vals[r][: num_top[r]])))
            for r, t in enumerate(token_ids)]


def prompt_logprobs_for_step(model: torch.nn.Module, hidden: torch.Tensor, req_ids: list[str],
                             num_scheduled: dict[str, int], query_start_loc: list[int],
                             requests: dict) -> dict[str, tuple[int, list[TokenLogprobs]]]:
    """For requests that ask for prompt logprobs: (start, the logprobs of prompt tokens start+1 .. end of this
    step's chunk), from the logits at positions start .. end-1 (one compute_logits call for all of them)."""
    rows: list[int] = []
    targets: list[int] = []
    owners: list[tuple[str, int, int, int]] = []  # (req_id, start position, first entry, number of entries)
    for k, r in enumerate(req_ids):
        state = requests[r]
        if state.sampling_params.prompt_logprobs is None:
            continue
        start = state.num_computed_tokens
        stop = min(start + num_scheduled[r], state.num_prompt_tokens - 1)
        if stop <= start:
            continue
        owners.append((r, start, len(targets), stop - start))
        rows.extend(query_start_loc[k] + p - start for p in range(start, stop))
        targets.extend(state.token_ids[p + 1] for p in range(start, stop))
    if not rows:
        return {}
    logits = model.compute_logits(hidden.index_select(0, torch.tensor(rows, device=hidden.device)))
    num_top = [requests[r].sampling_params.prompt_logprobs for r, _, _, n in owners for _ in range(n)]
    entries = token_logprobs(logits, targets, num_top)
    return {r: (start, entries[first:first + n]) for r, start, first, n in owners}
