"""Structured outputs in the runner: one grammar matcher (xgrammar) per constrained request, made from the
grammar the engine compiled at admission (engine/structured_output.py); in the sampler each constrained row's
matcher fills its row of one batch bitmask and one masked-fill applies them all. Rows without a matcher are not
touched."""
from __future__ import annotations

import logging
from typing import Any

import torch

from disagg.worker.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def apply_grammar_masks(logits: torch.Tensor, matchers: list[Any]) -> None:
    rows = [i for i, m in enumerate(matchers) if m is not None and not m.is_terminated()]
    if not rows:
        return
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(len(matchers), logits.shape[-1])
    for i in rows:
        matchers[i].fill_next_token_bitmask(bitmask, i)
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=rows)


def advance_matchers(matchers: list[Any], token_ids: list[int], req_ids: list[str]) -> None:
    for m, t, r in zip(matchers, token_ids, req_ids):
        if m is not None and not m.is_terminated() and not m.accept_token(t):
            logger.warning("request %s: grammar rejected sampled token %d", r, t)


def new_matcher(sp: SamplingParams, generated: list[int]) -> Any:
    """A grammar matcher for the request (None if unconstrained), advanced over tokens it already generated."""
    spec = sp.structured_output
    if spec is None or spec.compiled is None:
        return None
    import xgrammar as xgr

    matcher = xgr.GrammarMatcher(spec.compiled)
    for token_id in generated:
        if not matcher.accept_token(token_id):
            logger.warning("grammar replay rejected token %d", token_id)
            break
    return matcher
