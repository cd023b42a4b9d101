"""Container probes as the kubelet runs them: httpGet (path + named or numbered port) and grpc (gRPC health
checking: port + service) against the pod IP, with initialDelaySeconds, periodSeconds, timeoutSeconds,
failureThreshold and successThreshold.

Liveness and readiness wait for the startup probe to succeed; a failed startup or liveness probe restarts the
container; readiness only decides the Ready condition. `time_scale` shortens every probe period and delay (the
tier compresses probe timing, e.g. 0.2: a 10 s period becomes 2 s; grace periods and the programs' own timers
stay real).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import httpx

KINDS = ("startupProbe", "livenessProbe", "readinessProbe")


def resolve_port(port: int | str, container: dict[str, Any]) -> int:
    if isinstance(port, int) or str(port).isdigit():
        return int(port)
    for p in container.get("ports") or []:
        if p.get("name") == port:
            return int(p["containerPort"])
    raise ValueError(f"container {container['name']}: no port named {port!r}")


def grpc_probe(pod_ip: str, probe: dict[str, Any]) -> bool:
    """SERVING from grpc.health.v1.Health/Check for the probe's service (as the kubelet's gRPC probe)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    spec = probe["grpc"]
    with grpc.insecure_channel(f"{pod_ip}:{int(spec['port'])}") as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=spec.get("service", "")),
                timeout=float(probe.get("timeoutSeconds", 1)))
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def run_probe(pod_ip: str, container: dict[str, Any], probe: dict[str, Any]) -> bool:
    if "grpc" in probe:
        return grpc_probe(pod_ip, probe)
    get = probe.get("httpGet")
    if get is None:
        raise ValueError(f"container {container['name']}: only httpGet and grpc probes are supported, got "
                         f"{sorted(probe)}")
    url = f"http://{pod_ip}:{resolve_port(get['port'], container)}{get.get('path', '/')}"
    try:
        return 200 <= httpx.get(url, timeout=float(probe.get("timeoutSeconds", 1))).status_code < 400
    except httpx.HTTPError:
        return False


@dataclass
class ProbeState:
    kind: str  # startupProbe | livenessProbe | readinessProbe
    spec: dict[str, Any]
    time_scale: float
    started_at: float  # monotonic, container start
    next_at: float = 0.0
    failures: int = 0
    successes: int = 0
    passing: bool = False  # the probe's current verdict (readiness: Ready)

    def __post_init__(self) -> None:
        self.next_at = self.started_at + float(self.spec.get("initialDelaySeconds", 0)) * self.time_scale

    def due(self, now: float) -> bool:
        return now >= self.next_at

    def record(self, ok: bool, now: float) -> str | None:
        """Returns "failed" when failureThreshold consecutive failures are reached, "passed" on the transition
        to passing, else None."""
        self.next_at = now + float(self.spec.get("periodSeconds", 10)) * self.time_scale
        if ok:
            self.failures, self.successes = 0, self.successes + 1
            if not self.passing and self.successes >= int(self.spec.get("successThreshold", 1)):
                self.passing = True
                return "passed"
            return None
        self.successes, self.failures = 0, self.failures + 1
        if self.failures >= int(self.spec.get("failureThreshold", 3)):
            was = self.passing
            self.passing = False
            if self.kind != "readinessProbe" or was:
                return "failed"
        return None


@dataclass
class ContainerProbes:
    """The probes of one container run; tick() runs those due and says what the kubelet must do."""
    container: dict[str, Any]
    time_scale: float
    started_at: float = field(default_factory=time.monotonic)
    probes: dict[str, ProbeState] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for kind in KINDS:
            if self.container.get(kind):
                self.probes[kind] = ProbeState(kind, self.container[kind], self.time_scale, self.started_at)

    @property
    def started(self) -> bool:
        startup = self.probes.get("startupProbe")
        return startup is None or startup.passing

    @property
    def ready(self) -> bool:
        readiness = self.probes.get("readinessProbe")
        return self.started and (readiness is None or readiness.passing)

    def tick(self, pod_ip: str) -> str | None:
        """"restart" when a startup or liveness probe failed, else None."""
        now = time.monotonic()
        for kind in KINDS:
            state = self.probes.get(kind)
            if state is None or not state.due(now) or (kind != "startupProbe" and not self.started) \
                    or (kind == "startupProbe" and state.passing):
                continue
            verdict = state.record(run_probe(pod_ip, self.container, state.spec), time.monotonic())
            if verdict == "failed" and kind != "readinessProbe":
                return "restart"
        return None
