"""What clients talk to under `disagg up`: the router (default), or, with --gateway, a real Envoy configured as a
Gateway API inference gateway with our endpoint picker (`disagg epp`) - the two topologies of a cluster, on one
machine. Both follow the launcher's endpoints file as workers come and go; the gateway's fail-open pool (the
decode workers, an EDS file Envoy watches) is rewritten with it."""
from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from disagg.operator.plan import local_epp_command, local_router_command
from disagg.worker.local.process import ProcessSpec

CLI = [sys.executable, "-m", "disagg.worker.cli"]


@dataclass
class FrontDoor:
    procs: list[ProcessSpec]  # started in this order once the workers are up
    url: str  # where clients send requests
    membership_url: str  # whose GET /endpoints lists the workers it routes to (scale-down waits on it)
    ca_file: str | None = None  # an HTTPS front door's certificate (disagg up --tls)
    admin_url: str | None = None  # Envoy's admin, to drain it before it stops
    pool_file: Path | None = None  # the gateway's fail-open pool (EDS), rewritten with the membership
    on_membership: Callable[[dict[str, list[str]]], None] | None = field(default=None, repr=False)

    def verify(self) -> Any:
        from disagg.worker.local.self_signed import client_context

        return client_context(self.ca_file) if self.ca_file else True


def router_front_door(spec: Any, *, host: str, port: int, probe_interval_s: float, endpoints_file: str | None,
                      prefill_urls: list[str], decode_urls: list[str], tls: tuple[str, str] | None) -> FrontDoor:
    router = local_router_command(spec, host=host, port=port, probe_interval_s=probe_interval_s,
                                  endpoints_file=endpoints_file, prefill_urls=prefill_urls, decode_urls=decode_urls)
    flags = ["--tls-cert-file", tls[0], "--tls-key-file", tls[1]] if tls else []
    url = f"{'https' if tls else 'http'}://{host}:{port}"
    proc = ProcessSpec("router", [*CLI, *router[1:], *flags], url, role="router", ca_file=tls[0] if tls else None)
    return FrontDoor([proc], url, url, ca_file=proc.ca_file)


def gateway_front_door(spec: Any, *, host: str, port: int, port_for: Callable[[], int], endpoints_file: str,
                       probe_interval_s: float, log_dir: Path, decode_urls: list[str],
                       tls: tuple[str, str] | None) -> FrontDoor:
    """`disagg epp` following the endpoints file, and Envoy on `port` with ext_proc to it (failure mode as
    spec.gateway.failureMode), its fail-open pool the decode workers."""
    from disagg.worker.gateway.envoy import envoy_argv, find_envoy
    from disagg.worker.gateway.envoy_config import GatewayConfig, build_envoy_config, write_pool_endpoints

    epp, placement = local_epp_command(spec, host=host, port_for=port_for, endpoints_file=endpoints_file,
                                       probe_interval_s=probe_interval_s)
    epp_url = f"http://{host}:{placement.metrics_port}"
    pool_file = log_dir / "gateway" / "pool.json"
    pool_file.parent.mkdir(parents=True, exist_ok=True)

    def write_pool(urls: dict[str, list[str]]) -> None:
        write_pool_endpoints(pool_file, [(urlsplit(u).hostname, urlsplit(u).port) for u in urls["decode"]])

    write_pool({"decode": decode_urls})
    admin = port_for()
    config = GatewayConfig(host, port, host, placement.grpc_port, str(pool_file), admin,
                           spec.gateway.failure_mode, tls_cert_path=tls[0] if tls else None,
                           tls_key_path=tls[1] if tls else None)
    config_file = log_dir / "gateway" / "envoy.json"
    config_file.write_text(json.dumps(build_envoy_config(config), indent=1))
    url = f"{'https' if tls else 'http'}://{host}:{port}"
    procs = [ProcessSpec("epp", [*CLI, *epp[1:]], epp_url, role="epp"),
             # clients use the listener (`url`); its readiness is its admin's /ready
             ProcessSpec("gateway", envoy_argv(find_envoy(), str(config_file)), url, role="gateway",
                         ca_file=tls[0] if tls else None, probe_url=f"http://{host}:{admin}")]
    return FrontDoor(procs, url, epp_url, ca_file=tls[0] if tls else None, admin_url=f"http://{host}:{admin}",
                     pool_file=pool_file, on_membership=write_pool)
