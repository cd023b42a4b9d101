"""The one place the router's command line is built from (spec, placement).

The router pod (manifests.py) and `disagg up`'s router process both get it through plan.py; they differ only in
the RouterPlacement (placement.py): where it binds and where it finds its workers. A contract test parses every
command built here with the router's own parser.

Pure: no API calls, no processes.
"""
from __future__ import annotations

from disagg.operator import spec as s
from disagg.operator.naming import KV_EVENTS_TOPIC
from disagg.operator.placement import RouterPlacement
from disagg.operator.worker_command import EXECUTABLE, admission_args
from disagg.worker.router.waiting_room import DEFAULT_MAX_IN_FLIGHT_PER_ENDPOINT
from disagg.worker.server.admission import AdmissionLimits
from disagg.worker.server.args import parse_worker_args


def build_router_command(spec: s.DisaggregatedInferenceSpec, placement: RouterPlacement) -> list[str]:
    """`disagg router ...` (argv[0] is EXECUTABLE), spec.router.extraArgs last so a user's flag wins."""
    argv = [EXECUTABLE, "router", "--host", placement.host, "--port", str(placement.port),
            *routing_args(spec, placement.discovery, placement.kv_events_ports, placement.probe_interval_s),
            "--max-request-body-bytes", str(spec.router.admission.max_request_body_bytes),
            "--max-in-flight-per-endpoint", str(in_flight_per_endpoint(spec))]
    if placement.tls_files is not None:
        cert, key = placement.tls_files
        argv += ["--tls-cert-file", cert, "--tls-key-file", key]
    return [*argv, *spec.router.extra_args]


def in_flight_per_endpoint(spec: s.DisaggregatedInferenceSpec) -> int:
    """spec.router.admission.maxInFlightPerEndpoint, or what one decode worker takes at once: its running batch
    plus its waiting queue, as the worker reads them from its own flags (engine vllm: 0, its queue has no bound)."""
    if (bound := spec.router.admission.max_in_flight_per_endpoint) is not None:
        return bound
    if spec.engine == "vllm":  # vLLM's users expect requests to queue there
        return 0
    try:  # the flags that size the decode worker, in the order its command has them
        args = parse_worker_args(["--role", "decode", *admission_args(spec.decode.admission), *spec.engine_args,
                                  *spec.decode.extra_args])
    except ValueError:  # flags the worker rejects: the spec's checks name them (checks.command_problems)
        return DEFAULT_MAX_IN_FLIGHT_PER_ENDPOINT
    limits = AdmissionLimits.of(args.max_num_seqs, args.max_num_batched_tokens, args.max_waiting_requests,
                                args.max_waiting_prompt_tokens, role="decode")
    return args.max_num_seqs + limits.max_waiting_requests


def routing_args(spec: s.DisaggregatedInferenceSpec, discovery: tuple[str, ...],
                 kv_events_ports: tuple[int, int] | None, probe_interval_s: float | None = None) -> list[str]:
    """What every program that routes by spec.router takes (the router, the endpoint picker): the policy, the
    discovery, the bounds and, for prefix-aware, where the workers publish KV-cache events."""
    r = spec.router
    argv = ["--policy", r.policy]
    if probe_interval_s is not None:
        argv += ["--probe-interval", str(probe_interval_s)]
    argv += [*discovery, *bound_args(r, spec.engine), *hold_args(spec.autoscaling)]
    if r.policy == "prefix-aware" and kv_events_ports is not None:
        # where the workers publish KV-cache events, for those that do not say so at GET /kv_events (vLLM)
        pub, replay = kv_events_ports
        argv += ["--kv-events-port", str(pub), "--kv-events-replay-port", str(replay),
                 "--kv-events-topic", KV_EVENTS_TOPIC]
    return argv


def timeout_args(timeouts: s.RouterTimeouts) -> list[str]:
    """The hop bounds of spec.router.timeouts, as every program that runs a hop takes them."""
    t = timeouts
    return ["--connect-timeout", str(t.connect_seconds), "--first-byte-timeout", str(t.first_byte_seconds),
            "--idle-timeout", str(t.idle_seconds), "--request-timeout", str(t.request_seconds)]


def bound_args(router: s.RouterSpec, engine: str) -> list[str]:
    """The router's flags for spec.router's timeouts, outlier detection, prefix-aware weights and queue wait."""
    t, o, x = router.timeouts, router.outlier_detection, router.prefix_aware
    return [*timeout_args(t), "--unresponsive-after", f"{t.unresponsive_after(engine):g}",
            "--eject-after-failures", str(o.consecutive_failures),
            "--ejection-seconds", str(o.base_ejection_seconds),
            "--max-ejection-seconds", str(o.max_ejection_seconds),
            "--prefix-load-cost-tokens", str(x.load_cost_tokens),
            "--prefix-skip-prefill-blocks", str(x.skip_prefill_blocks),
            "--queue-wait", f"{router.admission.queue_wait_seconds:g}"]


def hold_args(autoscaling: s.AutoscalingSpec) -> list[str]:
    """With scale to zero the router holds requests while no decode pod is ready (worker/router/hold.py)."""
    if not autoscaling.holds_requests():
        return []
    z = autoscaling.scale_to_zero
    return ["--hold-seconds", str(z.hold_seconds), "--max-held-requests", str(z.max_held_requests)]
