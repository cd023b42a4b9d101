"""The one place the command line of `disagg pd-proxy` is built from (spec, role, placement): the container in
front of vLLM in every vLLM pod (engine vllm). It owns the pod's HTTP port: it signs the prefill's hand-off,
checks one before vLLM sees it and, behind a gateway, runs the decode side's prefill hop (only to the prefill
pods placement.prefill_pool names). A contract test parses every command built here with its own parser.

Pure: no API calls, no processes.
"""
from __future__ import annotations

from disagg.operator import spec as s
from disagg.operator.placement import ProxyPlacement
from disagg.operator.router_command import timeout_args
from disagg.operator.worker_command import EXECUTABLE, Role


def build_pd_proxy_command(spec: s.DisaggregatedInferenceSpec, role: Role, placement: ProxyPlacement) -> list[str]:
    """`disagg pd-proxy ...` (argv[0] is EXECUTABLE): its hops are bounded as the router's are
    (spec.router.timeouts; vLLM's late /health under load as the router allows it); it drains as long as vLLM
    behind it (the same share of the grace period)."""
    argv = [EXECUTABLE, "pd-proxy", "--role", role, "--engine-url", placement.engine_url,
            "--host", placement.host, "--port", str(placement.port),
            "--kv-lease-seconds", str(spec.kv_transfer.lease_seconds),
            "--drain-timeout", str(max(1, s.request_drain_seconds(spec, role)))]
    if role == "decode" and placement.prefill_pool is not None:
        argv += placement.prefill_pool.flags()
    t = spec.router.timeouts
    return [*argv, *timeout_args(t), "--unresponsive-after", f"{t.unresponsive_after(spec.engine):g}"]
