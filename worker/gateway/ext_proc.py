"""The endpoint-picker protocol of the Gateway API Inference Extension over Envoy's ext_proc gRPC stream.

Per request Envoy sends the request headers, then (BUFFERED body mode) the whole body. The picker answers the
headers with "continue" - or refuses the request there when it can without its body (no API key; the pool at
capacity and no room within the queue wait), before the gateway reads and forwards the body - and the body
with where to send the request:
  - header `x-gateway-destination-endpoint: ip:port` (what Envoy's ORIGINAL_DST cluster routes to), the same in
    dynamic metadata `envoy.lb` (what other GIE gateways read), and for P/D `x-prefiller-host-port` naming the
    prefill endpoint the decode side calls; client-sent copies of either are removed;
  - or an immediate response: 503 when nothing is ready, 429 when the picker sheds load, 401 without a valid
    client API key (gateway/picker.AuthenticatingPicker).
A request without a body (GET /v1/models) is routed at its headers. A subset hint (filter metadata
`envoy.lb.subset_hint`, key `x-gateway-destination-endpoint-subset`: a list of "ip:port") limits the choice.

This module knows the protocol only; what to pick is a `Picker`'s business (epp.py wires the router's policies).
"""
from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import grpc

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2 as pm
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

from disagg.worker.gateway.envoy_config import DESTINATION_HEADER, LB_NAMESPACE, PREFILL_HEADER

logger = logging.getLogger(__name__)

SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"


@dataclass(frozen=True)
class PickRequest:
    method: str
    path: str
    headers: dict[str, str]  # lower-case names
    body: bytes
    subset: tuple[str, ...] | None = None  # "ip:port" the gateway allows; None: any


@dataclass(frozen=True)
class Pick:
    """Where a request goes: `decode` (ip:port) and, for P/D, `prefill`; or `status` 503/429 with a message."""
    decode: str | None = None
    prefill: str | None = None
    status: int = 200
    message: str = ""
    retry_after_s: int | None = None
    headers: dict[str, str] = field(default_factory=dict)  # more request headers to set (e.g. x-request-id)


class Picker(Protocol):
    async def pick(self, request: PickRequest) -> Pick: ...

    # optional: `async admit(request) -> Pick | None` - a refusal at the headers (request.body is empty then);
    # `done(pick)`, `answered(pick, status, retry_after)` - see EndpointPickerService


def _header_value(h: base_pb2.HeaderValue) -> str:
    return h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value


def _subset(request: ep.ProcessingRequest) -> tuple[str, ...] | None:
    hint = request.metadata_context.filter_metadata.get(SUBSET_NAMESPACE)
    if hint is None or SUBSET_KEY not in hint.fields:
        return None
    value = hint.fields[SUBSET_KEY]
    if value.HasField("list_value"):
        return tuple(v.string_value for v in value.list_value.values if v.string_value)
    return tuple(s.strip() for s in value.string_value.split(",") if s.strip())


def _set(name: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=name, raw_value=value.encode()),
                                      append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD)


def routed(pick: Pick, at_headers: bool) -> ep.ProcessingResponse:
    """The answer that sends the request to pick.decode (with the prefill header for P/D)."""
    sets = [_set(DESTINATION_HEADER, pick.decode)]
    if pick.prefill:
        sets.append(_set(PREFILL_HEADER, pick.prefill))
    sets += [_set(k, v) for k, v in pick.headers.items()]
    # a client's copy of the prefill header must never reach a worker (the gateway strips it too)
    common = ep.CommonResponse(clear_route_cache=True, header_mutation=ep.HeaderMutation(
        set_headers=sets, remove_headers=[] if pick.prefill else [PREFILL_HEADER]))
    metadata = struct_pb2.Struct()
    metadata.update({LB_NAMESPACE: {DESTINATION_HEADER: pick.decode}})
    if at_headers:
        return ep.ProcessingResponse(request_headers=ep.HeadersResponse(response=common), dynamic_metadata=metadata)
    return ep.ProcessingResponse(request_body=ep.BodyResponse(response=common), dynamic_metadata=metadata)


def refused(pick: Pick) -> ep.ProcessingResponse:
    """An immediate response in the OpenAI error shape (503 nothing ready, 429 shed, 401 no valid API key)."""
    kind = {401: "authentication_error", 429: "rate_limit_exceeded", 503: "service_unavailable"}.get(pick.status,
                                                                                                    "error")
    body = json.dumps({"error": {"message": pick.message, "type": kind, "param": None, "code": pick.status}})
    headers = [_set("content-type", "application/json")]
    if pick.status == 401:
        headers.append(_set("www-authenticate", "Bearer"))
    if pick.retry_after_s is not None:
        headers.append(_set("retry-after", str(pick.retry_after_s)))
    return ep.ProcessingResponse(immediate_response=ep.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=pick.status), headers=ep.HeaderMutation(set_headers=headers),
        body=body.encode(), details=f"endpoint_picker_{pick.status}"))


FULL_DUPLEX = 4  # ProcessingMode.FULL_DUPLEX_STREAMED
BODY_CHUNK_BYTES = 62_000  # a streamed body goes back in chunks below Envoy's 64 KiB message limit


def _streamed_body(body: bytes, request: bool, end: bool = True) -> list[ep.ProcessingResponse]:
    """A body handed back in full-duplex mode (Envoy forwards what the processor sends), in chunks."""
    chunks = [body[i:i + BODY_CHUNK_BYTES] for i in range(0, len(body), BODY_CHUNK_BYTES)] or [b""]
    out = []
    for i, chunk in enumerate(chunks):
        answer = ep.BodyResponse(response=ep.CommonResponse(body_mutation=ep.BodyMutation(
            streamed_response=ep.StreamedBodyResponse(body=chunk, end_of_stream=end and i == len(chunks) - 1))))
        out.append(ep.ProcessingResponse(request_body=answer) if request else ep.ProcessingResponse(response_body=answer))
    return out


class EndpointPickerService(ep_grpc.ExternalProcessorServicer):
    """One ext_proc stream per HTTP request. BUFFERED body mode (our Envoy's): the headers are answered at once
    and the routing goes with the body's answer. FULL_DUPLEX_STREAMED (GIE's reference gateways): nothing is
    answered until the body is complete; then the routing goes with the headers' answer and the body is sent
    back as streamed chunks. Either way the picker sees the whole body once. Response messages, where a gateway
    sends them, pass unchanged. `on_done` (the stream closed: the request ended, or in full-duplex mode without
    response processing, its routing did) lets the picker count requests in flight per endpoint; `answered`
    (the response's headers, where the gateway sends them) tells it the worker's status.

    Reads and writes go through the context rather than a generator: grpcio's server hung at stop() after a
    generator handler was cancelled mid-stream (Envoy closes a full-duplex stream once nothing is left to
    process)."""

    def __init__(self, picker: Picker):
        self.picker = picker

    async def Process(self, request_iterator: AsyncIterator[ep.ProcessingRequest], context: Any) -> None:
        exchange = _Exchange(self.picker)
        try:
            while (message := await context.read()) is not grpc.aio.EOF:
                for response in await exchange.answer(message):
                    await context.write(response)
        finally:
            exchange.done()


class _Exchange:
    """One request's messages -> the answers they get."""

    def __init__(self, picker: Picker):
        self.picker = picker
        self.headers: dict[str, str] = {}
        self.subset: tuple[str, ...] | None = None
        self.body = b""
        self.request_duplex = self.response_duplex = False
        self.body_modes: tuple[int, int] | None = None  # (request, response) body modes, where Envoy says them
        self.pick: Pick | None = None

    def done(self) -> None:
        on_done = getattr(self.picker, "done", None)
        if self.pick is not None and on_done is not None:
            on_done(self.pick)

    async def answer(self, message: ep.ProcessingRequest) -> list[ep.ProcessingResponse]:
        if message.HasField("protocol_config"):
            self.request_duplex = message.protocol_config.request_body_mode == FULL_DUPLEX
            self.response_duplex = message.protocol_config.response_body_mode == FULL_DUPLEX
            self.body_modes = (message.protocol_config.request_body_mode,
                               message.protocol_config.response_body_mode)
        kind = message.WhichOneof("request")
        if kind == "request_headers":
            self.headers = {h.key.lower(): _header_value(h) for h in message.request_headers.headers.headers}
            self.subset = _subset(message)
            if message.request_headers.end_of_stream:  # no body: route now
                return [self._with_response_headers(await self._route(at_headers=True))]
            early = await self._admit()
            if early is not None:  # refused before its body is read (the gateway buffers none of it)
                return [refused(early)]
            return [] if self.request_duplex else \
                [self._with_response_headers(ep.ProcessingResponse(request_headers=ep.HeadersResponse()))]
        if kind == "request_body":
            self.body += message.request_body.body
            if not message.request_body.end_of_stream:  # STREAMED mode answers each part; full duplex waits
                return [] if self.request_duplex else [ep.ProcessingResponse(request_body=ep.BodyResponse())]
            routing = await self._route(at_headers=self.request_duplex)
            if self.request_duplex and routing.HasField("request_headers"):
                return [routing, *_streamed_body(self.body, request=True)]
            return [routing]
        if kind == "request_trailers":
            return [ep.ProcessingResponse(request_trailers=ep.TrailersResponse())]
        if kind == "response_headers":
            self._answered(message.response_headers)
            return [ep.ProcessingResponse(response_headers=ep.HeadersResponse())]
        if kind == "response_body":
            if self.response_duplex:  # hand each part straight back
                return _streamed_body(message.response_body.body, request=False,
                                      end=message.response_body.end_of_stream)
            return [ep.ProcessingResponse(response_body=ep.BodyResponse())]
        if kind == "response_trailers":
            return [ep.ProcessingResponse(response_trailers=ep.TrailersResponse())]
        logger.debug("ext_proc: unexpected %s message", kind)
        return []

    def _answered(self, headers: ep.HttpHeaders) -> None:
        """The routed request's response status, for a picker that learns from it (a 429: that endpoint is
        saturated)."""
        on_answer = getattr(self.picker, "answered", None)
        if self.pick is None or on_answer is None:
            return
        values = {h.key.lower(): _header_value(h) for h in headers.headers.headers}
        try:
            status = int(values.get(":status", "0"))
        except ValueError:
            return
        on_answer(self.pick, status, values.get("retry-after"))

    def _with_response_headers(self, answer: ep.ProcessingResponse) -> ep.ProcessingResponse:
        """Asks for this request's response headers (`mode_override`, honoured where the gateway allows it, as
        ours does: it sends none by default): a request that goes on to a worker tells the picker its status,
        and a request refused at the gateway (admission control, the picker's own answers) costs no exchange
        for its reply. Only with a buffered body, whose modes the override must repeat (an override replaces
        them all)."""
        if answer.HasField("immediate_response") or self.body_modes is None or self.request_duplex:
            return answer
        answer.mode_override.CopyFrom(pm.ProcessingMode(
            response_header_mode=pm.ProcessingMode.SEND, request_body_mode=self.body_modes[0],
            response_body_mode=self.body_modes[1]))
        return answer

    async def _admit(self) -> Pick | None:
        """A picker's refusal at the headers (`admit`: no API key, or the pool is at capacity), else None."""
        admit = getattr(self.picker, "admit", None)
        if admit is None:
            return None
        request = PickRequest(self.headers.get(":method", ""), self.headers.get(":path", ""), self.headers, b"",
                              self.subset)
        try:
            return await admit(request)
        except Exception:  # noqa: BLE001 - the body's pick decides then
            logger.exception("admitting %s at its headers failed", request.path)
            return None

    async def _route(self, at_headers: bool) -> ep.ProcessingResponse:
        request = PickRequest(self.headers.get(":method", ""), self.headers.get(":path", ""), self.headers,
                              self.body, self.subset)
        try:
            pick = await self.picker.pick(request)
        except Exception:  # noqa: BLE001 - a picker bug must not hang the request: say 503
            logger.exception("picking an endpoint for %s failed", request.path)
            pick = Pick(status=503, message="the endpoint picker failed on this request", retry_after_s=1)
        if pick.status != 200 or not pick.decode:
            return refused(pick if pick.status != 200 else Pick(status=503, message="no endpoint picked"))
        self.pick = pick
        return routed(pick, at_headers)
