"""Envoy configured as a Gateway API Inference Extension gateway implementation configures it (pure: a dict).

    client -> listener (HTTPS with a certificate given) -> header_mutation (drop client-sent routing headers)
    -> buffer (the whole request before anything decides on it) -> admission_control (shed part of a flood in
    Envoy itself) -> ext_proc (our endpoint picker, request headers + the buffered body) -> router:
        picked (envoy.lb dynamic metadata)  -> cluster "picked": ORIGINAL_DST, x-gateway-destination-endpoint
        not picked (the picker failed open) -> cluster "pool": the InferencePool's endpoints, round robin

The picker answers 503/429 itself (an immediate response); a picker that cannot be reached gives 503 with
FailClose (`status_on_error`) and the pool's round robin with FailOpen (`failure_mode_allow`). The body is
buffered, not streamed: Envoy fails open only for buffered bodies (a streamed body cannot be replayed to another
route). The pool's endpoints come from a file Envoy watches (`pool_eds_path`, see `endpoints_file`), rewritten
as pods come and go.

Admission control (Envoy's filter: the client-side throttling of Google's SRE book): while more than
`shed_threshold` of the recent requests were answered 429 (by the picker or a worker: the pool is saturated),
Envoy refuses a share of the new ones itself, before they cost the picker a gRPC exchange - the share grows as
the 429s do, and the requests it lets through still meet the picker's exact admission. Its refusals are 429s
with Retry-After and the OpenAI error body, as the picker's are. Under a flood of ten times capacity on 2
cores, the picker's exchanges for requests it only refused took 0.5 cores away from the model servers
(bench/overload.py --gateway). Envoy's stat `http.gateway.admission_control.rq_rejected` counts its refusals.

Why the buffer filter: a reply Envoy makes before it has read the request's body (a refusal at the headers, by
admission control or the picker) closes an HTTP/1.1 connection, so every refused client of a flood connected
anew (3,000 new connections in 10 s at ten times capacity). With the whole request read first, the connection
stays open. Its limit is the model servers' body limit: a bigger body is answered 413 at the gateway.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from disagg.worker.body_limit import DEFAULT_MAX_BODY_BYTES

DESTINATION_HEADER = "x-gateway-destination-endpoint"  # GIE's endpoint-picker protocol: "ip:port" of the pick
PREFILL_HEADER = "x-prefiller-host-port"
LB_NAMESPACE = "envoy.lb"  # the dynamic-metadata namespace the picker names its pick in  # llm-d's P/D convention: the prefill endpoint the decode side calls
# headers only the picker may set: a client's would steer a request (or a worker's prefill hop) anywhere
PICKER_HEADERS = (DESTINATION_HEADER, PREFILL_HEADER)
FailureMode = Literal["FailOpen", "FailClose"]
_HCM = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"


@dataclass(frozen=True)
class GatewayConfig:
    listen_host: str  # the gateway's address (the OpenAI API)
    listen_port: int
    picker_host: str  # the endpoint picker's ext_proc gRPC server
    picker_port: int
    pool_eds_path: str  # the InferencePool's endpoints, an EDS file Envoy watches (endpoints_file)
    admin_port: int  # Envoy's admin (/ready, /stats), on listen_host
    failure_mode: FailureMode = "FailClose"
    picker_timeout_s: float = 10.0  # one ext_proc message (the picker may wait for a starting pod)
    connect_timeout_s: float = 5.0  # to a model server
    tls_cert_path: str | None = None  # the listener serves HTTPS with this certificate (chain) and key, PEM files
    tls_key_path: str | None = None
    shed_threshold: float | None = 0.05  # 429s above this share of recent requests: Envoy sheds too; None: never
    shed_window_s: float = 2.0  # how far back "recent" goes (a flood's end is forgotten within it)
    max_request_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # above: 413 at the gateway

    def __post_init__(self) -> None:
        if (self.tls_cert_path is None) != (self.tls_key_path is None):
            raise ValueError("GatewayConfig: tls_cert_path and tls_key_path go together")


def _cluster_address(host: str, port: int) -> dict[str, Any]:
    return {"address": {"socket_address": {"address": host, "port_value": port}}}


def _ext_proc_filter(c: GatewayConfig) -> dict[str, Any]:
    ext_proc: dict[str, Any] = {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
        "grpc_service": {"envoy_grpc": {"cluster_name": "endpoint_picker"}, "timeout": f"{c.picker_timeout_s:g}s"},
        # the response's headers of the requests the picker lets through (it asks, mode_override): a worker's
        # 429 tells it that endpoint is at capacity; the gateway's own replies (admission control's refusals,
        # the picker's) open no exchange - they were one per request of a flood
        "processing_mode": {"request_header_mode": "SEND", "response_header_mode": "SKIP",
                            "request_body_mode": "BUFFERED", "response_body_mode": "NONE",
                            "request_trailer_mode": "SKIP", "response_trailer_mode": "SKIP"},
        "allow_mode_override": True,
        "message_timeout": f"{c.picker_timeout_s:g}s",
        "failure_mode_allow": c.failure_mode == "FailOpen",
        # the picker's dynamic metadata (envoy.lb) is what the route matches on
        "metadata_options": {"receiving_namespaces": {"untyped": [LB_NAMESPACE]}},
    }
    if c.failure_mode == "FailClose":
        ext_proc["status_on_error"] = {"code": "ServiceUnavailable"}
    return {"name": "envoy.filters.http.ext_proc", "typed_config": ext_proc}


SHED_DETAILS = "denied_by_admission_control"  # the response code details of the filter's refusals
SHED_RETRY_AFTER_S = 1
SHED_MESSAGE = ("too many requests: the inference pool is at capacity and the gateway is shedding load; retry "
                f"after {SHED_RETRY_AFTER_S} s")


def _admission_control_filter(c: GatewayConfig) -> dict[str, Any]:
    """Refuses with probability ((n - s / threshold) / (n + 1)) over the last `shed_window_s` (n requests, s not
    answered 429); at most 95% (a share always reaches the picker, which sees the pool recover)."""
    assert c.shed_threshold is not None
    return {"name": "envoy.filters.http.admission_control", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.admission_control.v3.AdmissionControl",
        "enabled": {"default_value": True, "runtime_key": "gateway.admission_control.enabled"},
        "sampling_window": f"{c.shed_window_s:g}s",
        "sr_threshold": {"default_value": {"value": 100.0 * (1 - c.shed_threshold)},
                         "runtime_key": "gateway.admission_control.sr_threshold"},
        "rps_threshold": {"default_value": 5, "runtime_key": "gateway.admission_control.rps_threshold"},
        "max_rejection_probability": {"default_value": {"value": 95.0},
                                      "runtime_key": "gateway.admission_control.max_rejection_probability"},
        # only "the pool is saturated" counts against admission: a worker's 5xx is no reason to refuse others
        "success_criteria": {"http_criteria": {"http_success_status": [{"start": 100, "end": 429},
                                                                       {"start": 430, "end": 600}]}}}}


def _shed_reply() -> dict[str, Any]:
    """The filter answers 503 with an empty body; clients are told what the picker tells them when it sheds."""
    body = json.dumps({"error": {"message": SHED_MESSAGE, "type": "rate_limit_exceeded", "param": None,
                                 "code": 429}})
    refused_here = {"extension_filter": {"name": "envoy.access_loggers.extension_filters.cel", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.access_loggers.filters.cel.v3.ExpressionFilter",
        "expression": f"response.code_details == '{SHED_DETAILS}'"}}}
    return {"mappers": [{"filter": refused_here, "status_code": 429, "body": {"inline_string": body},
                         "headers_to_add": [
                             {"header": {"key": "retry-after", "value": str(SHED_RETRY_AFTER_S)}},
                             {"header": {"key": "content-type", "value": "application/json"}}]}]}


def _downstream_tls(c: GatewayConfig) -> dict[str, Any]:
    """The listener's TLS (Envoy reads the files at start; a plaintext request gets its connection closed)."""
    return {"name": "envoy.transport_sockets.tls", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.DownstreamTlsContext",
        "common_tls_context": {"tls_certificates": [{"certificate_chain": {"filename": c.tls_cert_path},
                                                     "private_key": {"filename": c.tls_key_path}}]}}}


def _whole_request(c: GatewayConfig) -> dict[str, Any]:
    return {"name": "envoy.filters.http.buffer", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.buffer.v3.Buffer",
        "max_request_bytes": c.max_request_body_bytes}}


def _strip_picker_headers() -> dict[str, Any]:
    return {"name": "envoy.filters.http.header_mutation", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.header_mutation.v3.HeaderMutation",
        "mutations": {"request_mutations": [{"remove": h} for h in PICKER_HEADERS]}}}


def build_envoy_config(c: GatewayConfig) -> dict[str, Any]:
    """Envoy's bootstrap (v3) for one gateway listener in front of one InferencePool."""
    # the picked route matches the picker's dynamic metadata, which no client can set: a client's own header
    # (stripped anyway) cannot steer a request the picker did not route (the picker failed open)
    picked = {"filter": LB_NAMESPACE, "path": [{"key": DESTINATION_HEADER}], "value": {"present_match": True}}
    routes = [
        {"match": {"prefix": "/", "dynamic_metadata": [picked]},
         "route": {"cluster": "picked", "timeout": "0s"}},  # 0: no overall bound (streams; the picker's bounds)
        {"match": {"prefix": "/"}, "route": {"cluster": "pool", "timeout": "0s"}},
    ]
    shedding = [_admission_control_filter(c)] if c.shed_threshold is not None else []
    hcm = {"@type": _HCM, "stat_prefix": "gateway", "stream_idle_timeout": "0s",
           "route_config": {"virtual_hosts": [{"name": "inference", "domains": ["*"], "routes": routes}]},
           "http_filters": [_strip_picker_headers(), _whole_request(c), *shedding, _ext_proc_filter(c),
                            {"name": "envoy.filters.http.router", "typed_config": {
                                "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}]}
    if shedding:
        hcm["local_reply_config"] = _shed_reply()
    connect = f"{c.connect_timeout_s:g}s"
    clusters = [
        {"name": "endpoint_picker", "type": "STATIC", "connect_timeout": connect,
         "typed_extension_protocol_options": {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
             "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
             "explicit_http_config": {"http2_protocol_options": {}}}},
         "load_assignment": {"cluster_name": "endpoint_picker", "endpoints": [
             {"lb_endpoints": [{"endpoint": _cluster_address(c.picker_host, c.picker_port)}]}]}},
        {"name": "picked", "type": "ORIGINAL_DST", "lb_policy": "CLUSTER_PROVIDED", "connect_timeout": connect,
         "original_dst_lb_config": {"use_http_header": True, "http_header_name": DESTINATION_HEADER}},
        {"name": "pool", "type": "EDS", "connect_timeout": connect, "eds_cluster_config": {"eds_config": {
            "resource_api_version": "V3",
            "path_config_source": {"path": c.pool_eds_path,
                                   "watched_directory": {"path": str(Path(c.pool_eds_path).parent)}}}}},
    ]
    chain: dict[str, Any] = {"filters": [{"name": "envoy.filters.network.http_connection_manager",
                                          "typed_config": hcm}]}
    if c.tls_cert_path is not None:
        chain["transport_socket"] = _downstream_tls(c)
    listener = {"name": "gateway", "address": {"socket_address": {"address": c.listen_host,
                                                                  "port_value": c.listen_port}},
                "filter_chains": [chain]}
    return {"node": {"id": "disagg-gateway", "cluster": "disagg-gateway"},  # a file EDS source needs both
            "static_resources": {"listeners": [listener], "clusters": clusters},
            "admin": {"address": {"socket_address": {"address": c.listen_host, "port_value": c.admin_port}}}}


def pool_assignment(endpoints: list[tuple[str, int]]) -> dict[str, Any]:
    """The EDS discovery response naming the pool's endpoints (host, port)."""
    return {"version_info": json.dumps(sorted(endpoints)), "resources": [{
        "@type": "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment", "cluster_name": "pool",
        "endpoints": [{"lb_endpoints": [{"endpoint": _cluster_address(h, p)} for h, p in sorted(endpoints)]}]}]}


def write_pool_endpoints(path: str | Path, endpoints: list[tuple[str, int]]) -> None:
    """Replace the EDS file atomically: Envoy reloads it when it is moved into its watched directory."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(pool_assignment(endpoints)))
    os.replace(tmp, path)
