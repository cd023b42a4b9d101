"""The one place the endpoint picker's command line (`disagg epp`) is built from (spec, placement).

The picker routes by spec.router (policy, timeouts, outlier detection, prefix-aware weights: the router's own
flags, router_command.routing_args) for the gateway instead of proxying itself. A contract test parses every
command built here with `disagg epp`'s own parser.

Pure: no API calls, no processes.
"""
from __future__ import annotations

from disagg.operator import spec as s
from disagg.operator.placement import EppPlacement
from disagg.operator.router_command import routing_args
from disagg.operator.worker_command import EXECUTABLE


def build_epp_command(spec: s.DisaggregatedInferenceSpec, placement: EppPlacement) -> list[str]:
    """`disagg epp ...` (argv[0] is EXECUTABLE), spec.gateway.endpointPicker.extraArgs last so a user's flag
    wins."""
    argv = [EXECUTABLE, "epp", "--host", placement.host, "--grpc-port", str(placement.grpc_port),
            "--health-port", str(placement.health_port), "--metrics-port", str(placement.metrics_port),
            *routing_args(spec, placement.discovery, placement.kv_events_ports)]
    return [*argv, *spec.gateway.endpoint_picker.extra_args]
