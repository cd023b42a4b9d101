"""The checks beyond the schema: what the CRD accepts but cannot be served (cross-field rules, what a target
needs, and every command a spec would produce parsed by the program that runs it). `disagg validate`, the operator
(reconcile) and `disagg up` (through plan.py) call check_spec().

Each problem names the field to change: `Problem("spec.decode.extraArgs", "...")`.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import ValidationError

from disagg.operator import spec as s
from disagg.operator.naming import MAX_NAME_LENGTH
from disagg.operator.epp_command import build_epp_command
from disagg.operator.placement import (
    MODELS_DIR, kubernetes_epp_placement, kubernetes_placement, kubernetes_prefill_pool,
)
from disagg.operator.worker_command import ROLES, build_worker_command, owned_flags
from disagg.worker.kv_transfer.connectors import connector_problem, declaration_of
from disagg.worker.server.args import parse_worker_args

Target = Literal["kubernetes", "local"]
# a pod's grace period must leave at least this for running requests after the preStop wait and the KV lease
MIN_REQUEST_DRAIN_SECONDS = 10
_DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


@dataclass(frozen=True)
class Problem:
    path: str  # e.g. "spec.autoscaling.prefill.minReplicas"
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}"


def pydantic_problems(err: ValidationError, prefix: str = "spec") -> list[Problem]:
    problems = []
    for e in err.errors():
        path = ".".join([prefix, *(str(p) if not isinstance(p, int) else f"[{p}]" for p in e["loc"])])
        problems.append(Problem(path.replace(".[", "["), e["msg"]))
    return problems


def check_spec(raw: Any, target: Target) -> tuple[s.DisaggregatedInferenceSpec | None, list[Problem]]:
    """Parse and check a spec: (the spec, []) when it can be served on `target`; else the problems, schema
    (pydantic) ones first; the checks beyond the schema only run on a spec that parsed (the spec is None
    when it did not)."""
    try:
        spec = s.parse_spec(raw)
    except ValidationError as e:
        return None, pydantic_problems(e)
    return spec, semantic_problems(spec, target)


def semantic_problems(spec: s.DisaggregatedInferenceSpec, target: Target) -> list[Problem]:
    """What the schema accepts but cannot be served. `target` adds what only Kubernetes needs."""
    problems: list[Problem] = []
    if (why := connector_problem(spec.kv_transfer.connector)) is not None:
        problems.append(Problem("spec.kvTransfer.connector", why))
    problems += _model_problems(spec) + _parallel_problems(spec) + _engine_problems(spec)
    a = spec.autoscaling
    for role in ("prefill", "decode"):
        bounds: s.ReplicaBounds = getattr(a, role)
        if bounds.min_replicas > bounds.max_replicas:
            problems.append(Problem(f"spec.autoscaling.{role}.minReplicas",
                                    f"minReplicas {bounds.min_replicas} > maxReplicas {bounds.max_replicas}"))
    lo, hi = a.prefill_decode_ratio.min, a.prefill_decode_ratio.max
    if lo and hi and lo.prefill * hi.decode > hi.prefill * lo.decode:  # lo.p/lo.d > hi.p/hi.d without floats
        problems.append(Problem("spec.autoscaling.prefillDecodeRatio",
                                f"min {lo.prefill}:{lo.decode} is above max {hi.prefill}:{hi.decode}"))
    if a.scale_to_zero.enabled and not a.enabled:
        problems.append(Problem("spec.autoscaling.scaleToZero.enabled", "needs spec.autoscaling.enabled: nothing "
                                "else brings the pools back from zero"))
    problems += _router_problems(spec.router) + _gateway_problems(spec)
    if a.metrics_source.type == "prometheus" and not a.metrics_source.prometheus_url:
        problems.append(Problem("spec.autoscaling.metricsSource.prometheusUrl", "required when type is prometheus"))
    rdma = spec.kv_transfer.rdma
    for role in ("prefill", "decode"):
        r: s.RoleSpec = getattr(spec, role)
        if rdma.enabled and rdma.resource_name and \
                rdma.resource_name in {*r.resources.requests, *r.resources.limits}:
            problems.append(Problem(f"spec.{role}.resources",
                                    f"{rdma.resource_name} is requested by kvTransfer.rdma.resourceName already "
                                    "(1 per pod): remove it here"))
        if r.drain_delay_seconds >= r.termination_grace_period_seconds:
            problems.append(Problem(f"spec.{role}.drainDelaySeconds",
                                    f"{r.drain_delay_seconds} must be below terminationGracePeriodSeconds "
                                    f"{r.termination_grace_period_seconds}"))
    problems += command_problems(spec)
    if target == "kubernetes":
        problems += _grace_problems(spec)
        if not spec.image:
            problems.append(Problem("spec.image", "required on Kubernetes (the worker image)"))
        declaration = declaration_of(spec.kv_transfer.connector)
        if declaration is not None and declaration.needs_shared_storage and spec.kv_transfer.shared_storage is None:
            problems.append(Problem("spec.kvTransfer.sharedStorage",
                                    f"required on Kubernetes for {declaration.name}: a ReadWriteMany PVC "
                                    "(claimName) that every prefill and decode pod mounts"))
        if spec.model.source.kind == "generated":
            problems.append(Problem("spec.model.source",
                                    "required on Kubernetes: set one of huggingFace, pvc, path, uri "
                                    "(a generated checkpoint is only for `disagg up`)"))
    return problems


def _router_problems(r: s.RouterSpec) -> list[Problem]:
    out = []
    t, o = r.timeouts, r.outlier_detection
    for name, value in (("firstByteSeconds", t.first_byte_seconds), ("idleSeconds", t.idle_seconds)):
        if value > t.request_seconds:
            out.append(Problem(f"spec.router.timeouts.{name}", f"{value} is above requestSeconds "
                               f"{t.request_seconds} (the request's total bounds every hop)"))
    if o.max_ejection_seconds < o.base_ejection_seconds:
        out.append(Problem("spec.router.outlierDetection.maxEjectionSeconds",
                           f"{o.max_ejection_seconds} is below baseEjectionSeconds {o.base_ejection_seconds}"))
    return out


def _gateway_problems(spec: s.DisaggregatedInferenceSpec) -> list[Problem]:
    g = spec.gateway
    if not g.enabled:
        return [Problem("spec.gateway.httpRoute", "is set but gateway.enabled is false: nothing would serve it")
                ] if g.http_route is not None else []
    # `disagg epp`'s parser is not importable in the operator image (no uvicorn); the contract test parses it
    extra = g.endpoint_picker.extra_args
    argv = build_epp_command(spec, kubernetes_epp_placement(namespace="ns", instance="x"))
    owned = {a for a in argv[:len(argv) - len(extra)] if a.startswith("--")}
    return [Problem("spec.gateway.endpointPicker.extraArgs", f"{flag} is set by the operator from the spec; "
                    "change the spec field instead")
            for flag in dict.fromkeys(a.split("=", 1)[0] for a in g.endpoint_picker.extra_args) if flag in owned]


def _model_problems(spec: s.DisaggregatedInferenceSpec) -> list[Problem]:
    uri = spec.model.source.uri
    if uri is None:
        return []
    scheme = uri.url.partition("://")[0].lower() if "://" in uri.url else ""
    if scheme not in s.URI_SCHEMES:
        return [Problem("spec.model.source.uri.url", f"scheme {scheme + '://' if scheme else '(none)'} in "
                        f"{uri.url!r} is not supported: use {', '.join(u + '://' for u in s.URI_SCHEMES)}")]
    if scheme == "s3" and not uri.url[len("s3://"):].split("/")[0]:
        return [Problem("spec.model.source.uri.url", f"{uri.url!r}: expected s3://bucket[/prefix]")]
    return []


def _parallel_problems(spec: s.DisaggregatedInferenceSpec) -> list[Problem]:
    """The built-in engine runs one device per worker: no tensor parallelism (yet). vLLM shards over
    tensorParallelSize GPUs of one pod: resources.gpus, when set, must give it that many."""
    if spec.engine == "vllm":
        return [Problem(f"spec.{role}.resources.gpus",
                        f"{r.resources.gpus} GPUs cannot hold tensorParallelSize {r.tensor_parallel_size}: "
                        f"set gpus >= {r.tensor_parallel_size} or leave it 0 (then the pod requests "
                        "tensorParallelSize GPUs)")
                for role in ("prefill", "decode")
                if 0 < (r := getattr(spec, role)).resources.gpus < r.tensor_parallel_size]
    return [Problem(f"spec.{role}.tensorParallelSize",
                    f"{getattr(spec, role).tensor_parallel_size} is not supported by the built-in engine, which "
                    "runs one device per worker: use 1")
            for role in ("prefill", "decode") if getattr(spec, role).tensor_parallel_size != 1]


def _engine_problems(spec: s.DisaggregatedInferenceSpec) -> list[Problem]:
    if spec.engine == "vllm" and spec.kv_transfer.connector not in s.VLLM_CONNECTORS:
        return [Problem("spec.kvTransfer.connector",
                        f"{spec.kv_transfer.connector} does not run with engine vllm: use "
                        f"{', '.join(s.VLLM_CONNECTORS)} (vLLM's own, which speaks the router's KV protocol)")]
    return []


def _grace_problems(spec: s.DisaggregatedInferenceSpec) -> list[Problem]:
    problems = []
    for role in ("prefill", "decode"):
        r: s.RoleSpec = getattr(spec, role)
        if r.drain_delay_seconds < r.termination_grace_period_seconds \
                and s.request_drain_seconds(spec, role) < MIN_REQUEST_DRAIN_SECONDS:
            problems.append(Problem(
                f"spec.{role}.terminationGracePeriodSeconds",
                f"{r.termination_grace_period_seconds} must be at least drainDelaySeconds "
                f"{r.drain_delay_seconds} + kvTransfer.leaseSeconds {spec.kv_transfer.lease_seconds} + "
                f"{MIN_REQUEST_DRAIN_SECONDS} for running requests, so a removed pod finishes its work"))
    return problems


def name_problems(name: str) -> list[Problem]:
    if len(name) > MAX_NAME_LENGTH or not _DNS_1035.match(name):
        return [Problem("metadata.name", f"{name!r}: expected a DNS-1035 label of at most {MAX_NAME_LENGTH} "
                                         "characters (lowercase letters, digits, '-', starting with a letter)")]
    return []


def command_problems(spec: s.DisaggregatedInferenceSpec) -> list[Problem]:
    """Parse each role's command as the worker would (a pod's placement; the model directory a placeholder, so
    `disagg up`'s specs are parsed too)."""
    problems = []
    for role in ROLES:
        pool = kubernetes_prefill_pool(namespace="ns", instance="x") if spec.gateway.enabled else None
        placement = kubernetes_placement(model_dir=MODELS_DIR, shared_storage=True, engine=spec.engine,
                                         prefill_pool=pool)
        try:
            owned = owned_flags(spec, role, placement)
            argv = build_worker_command(spec, role, placement).argv
        except ValueError as e:
            problems.append(Problem(f"spec.{role}", str(e)))
            continue
        given = (("engineArgs", spec.engine_args), (f"{role}.extraArgs", getattr(spec, role).extra_args))
        for field_name, args in given:
            for flag in (a.split("=", 1)[0] for a in args):
                if flag in owned:
                    problems.append(Problem(f"spec.{field_name}", f"{flag} is set by the operator from the spec; "
                                                                  "change the spec field instead"))
        if spec.engine == "vllm":
            continue  # vLLM's parser is not importable here (the operator image has no vLLM); its tier runs it
        try:
            parse_worker_args(argv[2:])
        except ValueError as e:
            problems.append(Problem(f"spec.{role}.extraArgs", f"the worker rejects its command line: {e}"))
    return list(dict.fromkeys(problems))  # engineArgs are in both roles' commands: one problem each
