"""The P/D hop protocol: a prefill hop (the prompt, max_tokens=1, do_remote_decode) whose hand-off the decode hop
carries, the decode answer streamed back, and the prefill's token streamed first when the decode worker can
continue after it (hop_bodies.early_first_chunk).

Retries only where no byte reached the client: a failed prefill hop moves to another prefill endpoint
(none left: decode alone, computing the prompt itself); a decode hop that fails before its first byte
moves to another decode endpoint. A decode stream broken midway ends with an SSE error event (relay.py).
Every wait is bounded (timeouts.py): a hop that runs past its bound fails over as a failed one does; with no
decode endpoint left the client gets a 504 (503 when none could be reached), never a half-written 200. Failed
endpoints are ejected for a while (outliers.py).

A worker at capacity (429) is no failure (capacity.py): it is skipped until its Retry-After and the request goes
to another endpoint of the pool; with every one saturated it waits for room, briefly, and is then shed with a
429 - before the prefill hop when every decode endpoint is saturated (a request that will be shed costs no
prefill), and when every prefill endpoint is (computing the prompt at a decode worker instead would carry the
overload to the decode pool and slow every stream running there). A full hop connection pool is a 503 with
Retry-After, and no verdict on any worker either.

A hand-off no decode took (every decode hop refused it, or the request was shed after its prefill) is released
at its prefill when the request is over (release_unread: POST RELEASE_PATH), so a flood of refusals does not
keep prefill KV blocks until their lease end.

Framework-free: `serve` takes a parsed body and the policy's plan and returns a Reply, so the router's HTTP app
(app.py), a decode-side hop (the pools hold the prefill endpoints it may use and itself; the plan's costs put the
named prefill first) and `prefill_hop` alone (a decode worker that prefills remotely, then decodes itself) share it.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx

from disagg.worker.kv_transfer.handoff import Handoff, HandoffError
from disagg.worker.router.capacity import Shed, next_endpoint, released, saturated
from disagg.worker.router.handoffs import Ticket
from disagg.worker.router.hop_bodies import (HANDOFF_FIELD, RELEASE_PATH, decode_bodies, early_first_chunk,
                                            needs_prompt_logits, prefill_body)
from disagg.worker.router.policy import RoutePlan
from disagg.worker.router.relay import DecodeStream, relay
from disagg.worker.router.draining import STOPPING_MESSAGE
from disagg.worker.router.replies import Reply, as_sse_error, busy_reply, error_reply, shed_reply, sse_error
from disagg.worker.router.state import RouterState
from disagg.worker.router.timeouts import Deadline, HopTimeout, within

logger = logging.getLogger(__name__)

RELEASE_TIMEOUT_S = 5.0  # a release call's bound (the lease frees the KV anyway when it fails)
_releases: set[asyncio.Task] = set()  # release calls in flight (a reference keeps each task alive)


@dataclass
class PrefillOutcome:
    handoff: Handoff | None = None  # for the decode hop; None: no prefill endpoint gave KV (decode alone)
    revision: str | None = None  # the prefill endpoint's serving revision
    answer: Any = None  # its JSON answer (the early first token is made from it)
    ticket: str | None = None  # the hand-off in the router's ledger (handoffs.py), when it names remote KV


async def serve(state: RouterState, plan: RoutePlan, path: str, body: dict[str, Any], headers: dict[str, str],
                deadline: Deadline) -> Reply:
    """One client request through the hops; `body` is a JSON object whose max_tokens were checked. The caller
    asked `room_for` the decode pool first (before planning: a request that will be shed costs nothing)."""
    outcome = PrefillOutcome()
    first_chunk: bytes | None = None
    if plan.skip_prefill and state.prefill.endpoints:
        state.metrics.skipped_prefill()  # decode holds (nearly) the whole prompt: no KV to move
    elif state.prefill.endpoints and not needs_prompt_logits(body):
        state.decode.pending += 1  # bound for the decode pool, at none of its endpoints yet (its door counts it)
        try:
            hop = await prefill_hop(state, plan, path, body, headers, deadline)
        finally:
            state.decode.pending -= 1
        if isinstance(hop, Reply):  # the request itself is bad (the decode worker would say the same), or shed
            if hop.status not in (429, 503):  # (those were counted as they were answered)
                state.metrics.request("bad_request")
            return hop
        outcome = hop
        if not outcome.handoff:
            state.metrics.fell_back_to_decode_alone()
        elif state.early_first_token:
            first_chunk = early_first_chunk(body, path, outcome.answer, outcome.handoff)
    revisions = {outcome.revision} if outcome.handoff else None
    if first_chunk is not None:
        return _continue_after_first_chunk(state, plan, path, body, outcome, first_chunk, headers, deadline,
                                           revisions)
    d_body, alone = decode_bodies(body, outcome.handoff)
    try:
        opened = await open_decode(state, plan, path, d_body, alone, headers, deadline, bool(body.get("stream")),
                                   revisions, ticket=outcome.ticket)
    finally:  # no decode took the hand-off (shed, refused, failed, the client left): free its KV now
        release_unread(state, outcome.ticket, headers)
    if isinstance(opened, Reply):
        return opened
    return Reply(200, stream=relay(state, opened, deadline), headers=headers)


async def prefill_hop(state: RouterState, plan: RoutePlan, path: str, body: dict[str, Any],
                      headers: dict[str, str], deadline: Deadline) -> PrefillOutcome | Reply:
    """The hand-off from the first prefill endpoint that gives one (an empty outcome when none could: decode
    alone), or a Reply to pass back: the prefill rejected the request (4xx), every prefill endpoint is at
    capacity (429), or the router's connections are all in use (503)."""
    failed: set[str] = set()
    p_body = prefill_body(body)
    while deadline.remaining() > 0:
        ep = await next_endpoint(state, state.prefill, lambda: state.pick_prefill(plan, failed), failed, deadline)
        if ep is None:
            break
        if isinstance(ep, Shed):
            return shed_reply(ep, headers)
        ep.outstanding += 1
        start = time.monotonic()
        try:  # the answer is one token: its first byte comes with the rest
            r = await within(state.client.post(ep.url + path, json=p_body, headers=headers,
                                               timeout=deadline.httpx_timeout()), deadline, "first_byte",
                             hung=ep.unresponsive)
        except httpx.PoolTimeout:
            return busy_reply(state, headers)
        except HopTimeout as e:
            failed.add(ep.url)
            state.hop_timed_out(state.prefill, ep, "prefill", start, e)
            continue
        except httpx.HTTPError as e:
            failed.add(ep.url)
            state.hop_failed(state.prefill, ep, "prefill", start, f"{type(e).__name__}: {e}")
            continue
        finally:
            released(state, state.prefill, ep)
        ep.answered()
        if r.status_code == 429:
            saturated(state, state.prefill, ep, r.headers.get("retry-after"), refused_counted=False)
            continue
        if r.status_code >= 500:
            failed.add(ep.url)
            state.hop_failed(state.prefill, ep, "prefill", start, f"HTTP {r.status_code}: {r.text[:200]}")
            continue
        state.metrics.hop("prefill", time.monotonic() - start, error=False)
        state.prefill.mark_ok(ep)
        if r.status_code >= 400:
            return Reply(r.status_code, r.content, headers=headers)
        outcome = _handoff_of(ep.url, ep.revision, r)
        if outcome.handoff is not None and outcome.handoff.remote is not None:
            outcome.ticket = uuid.uuid4().hex
            state.handoffs.handed_off(outcome.ticket, ep.url, outcome.handoff.remote.lease_expires_at,
                                      outcome.handoff)
        return outcome
    if state.prefill.endpoints:
        logger.warning("request %s: no prefill endpoint available (%d known); decode computes the prompt",
                       headers["X-Request-Id"], len(state.prefill.endpoints))
    return PrefillOutcome()


def _handoff_of(url: str, revision: str | None, r: httpx.Response) -> PrefillOutcome:
    try:
        answer = r.json()
        params = answer.get("kv_transfer_params")
    except (json.JSONDecodeError, AttributeError):
        logger.warning("prefill %s answered without JSON; decoding alone", url)
        return PrefillOutcome()
    try:
        handoff = Handoff.parse(params) if params else None
    except HandoffError as e:
        logger.warning("prefill %s answered a malformed hand-off (%s); decoding alone", url, e)
        return PrefillOutcome()
    return PrefillOutcome(handoff, revision, answer)


def _continue_after_first_chunk(state: RouterState, plan: RoutePlan, path: str, body: dict[str, Any],
                                outcome: PrefillOutcome, first_chunk: bytes, headers: dict[str, str],
                                deadline: Deadline, revisions: set[str | None] | None) -> Reply:
    """The stream starts with the prefill's token (early_first_chunk); a decode worker continues after it
    (delivered_token_ids). The 200 is sent with that chunk, so a decode hop that fails from here on ends the
    stream with an SSE error event, as a stream broken midway does."""
    # decoding alone (no decode of the prefill's revision is left) still continues after the delivered token
    d_body, alone = decode_bodies(body, outcome.handoff, delivered=outcome.handoff.output_token_ids)
    state.metrics.first_byte(time.monotonic() - deadline.started)
    state.metrics.early_first_token()

    async def chunks() -> AsyncIterator[bytes]:
        yield first_chunk
        try:
            came, opened = await state.drain.unless_stopping(open_decode(
                state, plan, path, d_body, alone, headers, deadline, True, revisions, count_first_byte=False,
                ticket=outcome.ticket, committed=True))
        except (asyncio.CancelledError, GeneratorExit):  # the client left before a decode took the request
            state.metrics.request("client_gone")
            raise
        finally:
            release_unread(state, outcome.ticket, headers)
        if not came:  # the router's drain timeout ran out
            yield sse_error(STOPPING_MESSAGE, 503, "service_unavailable")
            return
        if isinstance(opened, Reply):  # no decode worker took it: what it would have said, as an event
            yield as_sse_error(opened)
            return
        async for chunk in relay(state, opened, deadline):
            yield chunk

    return Reply(200, stream=chunks(), headers=headers)


async def open_decode(state: RouterState, plan: RoutePlan, path: str, d_body: dict[str, Any],
                      alone: dict[str, Any], headers: dict[str, str], deadline: Deadline, stream: bool,
                      revisions: set[str | None] | None, count_first_byte: bool = True,
                      ticket: str | None = None, committed: bool = False) -> DecodeStream | Reply:
    """A decode endpoint's stream that has its first byte, or the Reply to give the client (the whole answer
    when not streamed, or why none came). `ticket`: the hand-off d_body carries, in the router's ledger.
    `committed`: the client has its 200 already: with every decode endpoint at capacity it waits for room
    (capacity.next_endpoint) rather than being shed mid-answer."""
    tried: set[str] = set()  # sent to
    failed: set[str] = set()  # and failed (a 429 is no failure: the endpoint waits out its Retry-After)
    timed_out: str | None = None  # the last hop that ran past a bound: "url: why"
    # a non-streamed answer has no first byte before it is complete: only the total bounds it
    stage = "first_byte" if stream else "total"
    while deadline.remaining() > 0:
        # none ready: one that answers its probes (a pod just started, in a rollout's hand-over) may be ready
        # within the connect bound - waited for once, before any other try, rather than refused at once
        ep = await next_endpoint(state, state.decode, lambda: state.pick_decode(plan, failed, revisions), failed,
                                 deadline, wait_ready=not tried, committed=committed)
        if ep is None:
            break
        if isinstance(ep, Shed):
            return shed_reply(ep, headers)
        tried.add(ep.url)
        if d_body is not alone and revisions is not None and ep.revision not in revisions:
            # no decode of the prefill's revision is left (a rollout removed it): KV of another revision may
            # not fit this engine, so it computes the prompt itself; prefill's blocks go at the lease
            logger.info("request %s: decode %s is of revision %s, not the prefill's; decoding alone",
                        headers["X-Request-Id"], ep.url, ep.revision)
            state.metrics.fell_back_to_decode_alone()
            d_body = alone
        ep.outstanding += 1
        start = time.monotonic()
        resp, kept, freed = None, False, True  # kept: the count and the response go on with the stream returned
        carried = ticket if d_body is not alone else None  # the hand-off goes to this endpoint
        if carried is not None:
            state.handoffs.decode_sent(carried, ep.url)
        try:
            request = state.client.build_request("POST", ep.url + path, json=d_body, headers=headers,
                                                 timeout=deadline.httpx_timeout())
            resp = await within(state.client.send(request, stream=True), deadline, stage, since=start,
                                hung=ep.unresponsive)
            ep.answered()
            if resp.status_code == 429:
                await within(resp.aread(), deadline, "idle")
                freed = False
                saturated(state, state.decode, ep, resp.headers.get("retry-after"))
                settle_handoff(state, carried, consumed=False)
                continue
            if resp.status_code >= 500:
                await within(resp.aread(), deadline, "idle")
                raise httpx.HTTPStatusError(f"HTTP {resp.status_code}: {resp.text[:200]}", request=resp.request,
                                            response=resp)
            if resp.status_code >= 400 or not stream:
                # a broken or abandoned body is retried: nothing was sent yet
                content = await within(resp.aread(), deadline, stage, since=start, hung=ep.unresponsive)
                state.metrics.hop("decode", time.monotonic() - start, error=False)
                state.decode.mark_ok(ep)
                if carried is not None and 400 <= resp.status_code < 500 and refused_handoff(content):
                    # the decode side refused the hand-off this router made (most often: the request waited
                    # past the prefill's lease on its KV), not the client's request: it computes the prompt
                    logger.warning("request %s: decode %s refused the hand-off (%s); decoding alone",
                                   headers["X-Request-Id"], ep.url, content[:300].decode(errors="replace"))
                    state.metrics.fell_back_to_decode_alone()
                    settle_handoff(state, carried, consumed=False)
                    d_body = alone
                    continue
                state.metrics.request("ok" if resp.status_code < 400 else "bad_request")
                settle_handoff(state, carried, consumed=resp.status_code < 400)
                return Reply(resp.status_code, content, headers=headers)
            chunks = resp.aiter_raw()
            # before the first byte, a failure can still be retried
            first = await within(chunks.__anext__(), deadline, "first_byte", since=start, hung=ep.unresponsive)
        except httpx.PoolTimeout:
            settle_handoff(state, carried, consumed=False)
            return busy_reply(state, headers)
        except (HopTimeout, httpx.HTTPError, StopAsyncIteration) as e:
            failed.add(ep.url)
            settle_handoff(state, carried, consumed=False, maybe_read=True)  # it may be reading the KV
            if isinstance(e, HopTimeout):
                state.hop_timed_out(state.decode, ep, "decode", start, e)
                timed_out = f"{ep.url}: {e}"
            else:
                state.hop_failed(state.decode, ep, "decode", start, f"{type(e).__name__}: {e}")
            continue
        else:
            kept = True
        finally:  # also when the client left (cancelled): the connection closes, the worker aborts
            if not kept:
                if resp is not None:
                    await resp.aclose()
                released(state, state.decode, ep, freed)
        state.decode.mark_ok(ep)
        settle_handoff(state, carried, consumed=True)
        if count_first_byte:
            state.metrics.first_byte(time.monotonic() - deadline.started)
        return DecodeStream(ep, resp, first, chunks, start)
    return _no_decode_answer(state, tried, timed_out, deadline)


def refused_handoff(content: bytes) -> bool:
    """A worker's (or pd-proxy's) 4xx names the hand-off as what it refused (param kv_transfer_params.*:
    handoff_auth.HandoffRejected, a malformed hand-off)."""
    try:
        param = json.loads(content)["error"].get("param")
    except (ValueError, KeyError, TypeError, AttributeError):
        return False
    return isinstance(param, str) and param.startswith(f"{HANDOFF_FIELD}.")


def settle_handoff(state: RouterState, ticket: str | None, consumed: bool, maybe_read: bool = False) -> None:
    """The decode hop that carried a hand-off answered (its first byte: the KV was consumed) or failed; also a
    decode worker's own prefill hop once its engine admitted the request (server/pd_hop.py). `maybe_read`: a
    failed hop that did not say it refused the hand-off (its KV is then never released early)."""
    if ticket is None:
        return
    if not consumed:
        state.handoffs.decode_failed(ticket, maybe_read)
    elif (seconds := state.handoffs.decode_answered(ticket)) is not None:
        state.metrics.handoff_consumed(seconds)


def release_unread(state: RouterState, ticket: str | None, headers: dict[str, str]) -> None:
    """The request is over: when no decode may read its hand-off's KV (handoffs.HandoffLedger.unread), ask the
    prefill that keeps it to free it now, in the background. A prefill that cannot (vLLM's pd-proxy: 501) is
    not asked again; its KV goes at the lease end."""
    if ticket is None or state.client is None:
        return
    send = state.handoffs.unread(ticket)
    if send is None or send.handoff is None or send.prefill_url in state.handoffs.cannot_release:
        return
    auth = {k: v for k, v in headers.items() if k.lower() in ("authorization", "x-request-id")}
    task = asyncio.get_running_loop().create_task(_release(state, ticket, send, auth))
    _releases.add(task)
    task.add_done_callback(_releases.discard)


async def _release(state: RouterState, ticket: str, send: Ticket, headers: dict[str, str]) -> None:
    url = send.prefill_url
    try:
        r = await state.client.post(url + RELEASE_PATH, json={HANDOFF_FIELD: send.handoff.to_wire()}, headers=headers,
                                    timeout=RELEASE_TIMEOUT_S)
    except httpx.HTTPError as e:
        logger.info("request %s: releasing its unread KV at %s failed (%s: %s); it goes at the lease end",
                    headers.get("X-Request-Id"), url, type(e).__name__, e)
        return
    if r.status_code in (200, 404):  # freed now, or no longer kept there (pulled, expired)
        state.handoffs.released(ticket)
        state.metrics.kv_released(r.status_code == 200)
    elif r.status_code == 501:
        state.handoffs.cannot_release.add(url)
        logger.info("prefill %s cannot release KV early (%s); its unread KV goes at the lease end", url,
                    r.text[:200])
    else:
        logger.info("request %s: prefill %s refused to release its unread KV: HTTP %d %s",
                    headers.get("X-Request-Id"), url, r.status_code, r.text[:200])


def _no_decode_answer(state: RouterState, tried: set[str], timed_out: str | None, deadline: Deadline) -> Reply:
    """Nothing was sent to the client yet: a 504 when a bound ran out, else a 503."""
    known = len(state.decode.endpoints)
    if timed_out is not None or deadline.remaining() <= 0:
        state.metrics.request("timeout")
        last = f"; last: {timed_out}" if timed_out else ""
        return error_reply(504, f"no decode worker answered within the router's bounds (request total "
                           f"{deadline.timeouts.total_s:g} s; {known} known, {len(tried)} tried{last})", "timeout")
    state.metrics.request("unavailable")
    return error_reply(503, f"no decode endpoint available ({known} known, {len(tried)} tried)",
                       "service_unavailable")
