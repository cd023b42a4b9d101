"""The decode worker's own prefill hop, behind a gateway: the endpoint picker sent the request here and named the
prefill endpoint (x-prefiller-host-port). Before the request is admitted, the router's prefill hop runs from here
(router/decode_side.py: only to a prefill endpoint of this resource's pool; another of the pool when that one
fails); the request then goes to this engine with the hand-off, as if a router had sent it. A streamed request
whose first token the prefill's answer can stand for gets it at once (the router's early first token), and this
engine continues after it.

Decode alone (no KV moved) when the header names no prefill endpoint of the pool, none gave KV, the request
needs the prompt's logits, or (with a hand-off key) the prefill's hand-off is not signed for this resource; a
prefill that rejects the request (4xx) answers the client itself, and so does a 429 when every prefill endpoint
of the pool is at capacity (router/capacity.py: shed, not computed here).
"""
from __future__ import annotations

import json
import logging
from typing import Any

from fastapi.responses import Response

from disagg.worker.router.decode_side import prefill_for
from disagg.worker.router.hop_bodies import HANDOFF_FIELD, check_max_tokens, early_first_chunk, needs_prompt_logits
from disagg.worker.router.replies import Reply
from disagg.worker.router.state import RouterState

logger = logging.getLogger(__name__)


async def prefill_remotely(pd: RouterState, path: str, raw: bytes, target: str, request_id: str,
                           early_first_token: bool, signer: Any = None
                           ) -> tuple[bytes, bytes | None, bool, str | None] | Response:
    """(the body to admit - with the prefill's hand-off when one came -, the client's first SSE chunk or None,
    whether that hand-off was checked here against `signer`, its ticket in `pd`'s hand-off ledger: settle it with
    hops.settle_handoff once the engine admitted the request), or the prefill's own rejection of the request."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return raw, None, False, None  # admission answers the malformed body
    if not isinstance(body, dict) or body.get(HANDOFF_FIELD) is not None or check_max_tokens(body) \
            or needs_prompt_logits(body):
        return raw, None, False, None  # admission answers it (a hand-off given is checked as any other)
    outcome = await prefill_for(pd, target, path, body, {"X-Request-Id": request_id})
    if isinstance(outcome, Reply):  # the prefill's rejection, or every prefill at capacity (429, Retry-After)
        headers = {k: v for k, v in (outcome.headers or {}).items() if k.lower() == "retry-after"}
        return Response(outcome.content, status_code=outcome.status, media_type="application/json",
                        headers=headers or None)
    if outcome.handoff is None or not _signed_here(signer, outcome.handoff, request_id):
        return raw, None, False, None  # a refused hand-off stays pending at its prefill until its lease end
    first = early_first_chunk(body, path, outcome.answer, outcome.handoff) if early_first_token else None
    handoff = outcome.handoff.delivering(outcome.handoff.output_token_ids) if first is not None else outcome.handoff
    if first is not None:
        pd.metrics.early_first_token()
    return json.dumps({**body, HANDOFF_FIELD: handoff.to_wire()}).encode(), first, signer is not None, outcome.ticket


def _signed_here(signer: Any, handoff: Any, request_id: str) -> bool:
    """The prefill's hand-off is signed for this resource (or there is no key); a refused one is logged and the
    request decodes alone, as pd-proxy does."""
    from disagg.worker.kv_transfer.handoff_auth import HandoffRejected

    if signer is None:
        return True
    try:
        signer.verify(handoff)
    except HandoffRejected as e:
        logger.warning("request %s: the prefill's hand-off is refused (%s); decoding alone", request_id, e)
        return False
    return True


def merged_metrics(*pages: Any) -> bytes:
    """The worker's metrics page and its prefill hop's (distinct metric names: one exposition)."""
    return b"".join(p for p in pages if p)
