"""Envoy configured as a Gateway API Inference Extension gateway implementation configures it (pure: a dict).

    client -> listener (HTTPS with a certificate given) -> header_mutation (drop client-sent routing headers) -> ext_proc (our endpoint picker,
    request headers + the buffered body) -> router:
        picked (envoy.lb dynamic metadata)  -> cluster "picked": ORIGINAL_DST, x-gateway-destination-endpoint
        not picked (the picker failed open) -> cluster "pool": the InferencePool's endpoints, round robin

The picker answers 503/429 itself (an immediate response); a picker that cannot be reached gives 503 with
FailClose (`status_on_error`) and the pool's round robin with FailOpen (`failure_mode_allow`). The body is
buffered, not streamed: Envoy fails open only for buffered bodies (a streamed body cannot be replayed to another
route). The pool's endpoints come from a file Envoy watches (`pool_eds_path`, see `endpoints_file`), rewritten
as pods come and go.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

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

    def __post_init__(self) -> None:
        if (self.tls_cert_path is None) != (self.tls_key_path is None):
            raise ValueError("GatewayConfig: tls_cert_path and tls_key_path go together")


def _cluster_address(host: str, port: int) -> dict[str, Any]:
    return {"address": {"socket_address": {"address": host, "port_value": port}}}


def _ext_proc_filter(c: GatewayConfig) -> dict[str, Any]:
    ext_proc: dict[str, Any] = {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
        "grpc_service": {"envoy_grpc": {"cluster_name": "endpoint_picker"}, "timeout": f"{c.picker_timeout_s:g}s"},
        # the response's headers too: a worker's 429 tells the picker that endpoint is at capacity
        "processing_mode": {"request_header_mode": "SEND", "response_header_mode": "SEND",
                            "request_body_mode": "BUFFERED", "response_body_mode": "NONE",
                            "request_trailer_mode": "SKIP", "response_trailer_mode": "SKIP"},
        "message_timeout": f"{c.picker_timeout_s:g}s",
        "failure_mode_allow": c.failure_mode == "FailOpen",
        # the picker's dynamic metadata (envoy.lb) is what the route matches on
        "metadata_options": {"receiving_namespaces": {"untyped": [LB_NAMESPACE]}},
    }
    if c.failure_mode == "FailClose":
        ext_proc["status_on_error"] = {"code": "ServiceUnavailable"}
    return {"name": "envoy.filters.http.ext_proc", "typed_config": ext_proc}


def _downstream_tls(c: GatewayConfig) -> dict[str, Any]:
    """The listener's TLS (Envoy reads the files at start; a plaintext request gets its connection closed)."""
    return {"name": "envoy.transport_sockets.tls", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.DownstreamTlsContext",
        "common_tls_context": {"tls_certificates": [{"certificate_chain": {"filename": c.tls_cert_path},
                                                     "private_key": {"filename": c.tls_key_path}}]}}}


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
    hcm = {"@type": _HCM, "stat_prefix": "gateway", "stream_idle_timeout": "0s",
           "route_config": {"virtual_hosts": [{"name": "inference", "domains": ["*"], "routes": routes}]},
           "http_filters": [_strip_picker_headers(), _ext_proc_filter(c),
                            {"name": "envoy.filters.http.router", "typed_config": {
                                "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}]}
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
