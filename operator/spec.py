"""DisaggregatedInference spec and status: the single source of truth for the CRD schema, the operator,
`disagg validate` and the local launcher (`disagg up`).

Kubernetes API conventions: camelCase names, integers (never floats), units in names (`leaseSeconds`),
conditions + observedGeneration in status, no `phase`.

Over 300 lines on purpose: the whole resource (spec, status and the cross-field checks the schema cannot
express) reads top to bottom in one file, the way `kubectl explain` shows it; each model is a few lines.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Annotated, Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError, model_validator
from pydantic.alias_generators import to_camel

from disagg.worker.kv_transfer.connectors import CONNECTORS, connector_problem, declaration_of
from disagg.worker.router import endpoints as router_endpoints
from disagg.worker.router.policies import DEFAULT_POLICY, POLICY_NAMES
from disagg.worker.router.prefix_policy import PrefixPolicyConfig

GROUP = "disagg.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "DisaggregatedInference"
PLURAL = "disaggregatedinferences"
SINGULAR = "disaggregatedinference"
SHORT_NAMES = ["dinf"]

# children are named "<name>-prefill", "<name>-decode", "<name>-router": a 63-char DNS label minus the suffix
MAX_NAME_LENGTH = 55
# a pod's grace period must leave at least this for running requests after the preStop wait and the KV lease
MIN_REQUEST_DRAIN_SECONDS = 10
_DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")

# Kubernetes quantity: an integer or a string like "500m", "16Gi"
QUANTITY_PATTERN = r"^[0-9]+(\.[0-9]+)?(m|k|Ki|M|Mi|G|Gi|T|Ti|P|Pi|E|Ei)?$"
Quantity = Annotated[int, Field(ge=0)] | Annotated[str, StringConstraints(pattern=QUANTITY_PATTERN)]


class _Model(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid", strict=True)


class _FreeForm(BaseModel):
    """An object passed through to Kubernetes unchanged (affinity, valueFrom)."""
    model_config = ConfigDict(extra="allow", json_schema_extra={"x-kubernetes-preserve-unknown-fields": True})


# ---------------------------------------------------------------- model
class PvcSource(_Model):
    claim_name: str = Field(min_length=1, max_length=253, description="PersistentVolumeClaim holding the checkpoint.")
    path: str = Field("", max_length=1024, description="Checkpoint directory inside the volume; empty = volume root.")


# URI schemes `disagg fetch-model` downloads (worker/model/fetch.py); others are rejected by name
URI_SCHEMES = ("http", "https", "s3")


class HuggingFaceSource(_Model):
    repo: str = Field(min_length=1, max_length=256, pattern=r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$",
                      description="Hugging Face repo id, e.g. meta-llama/Llama-3.1-8B-Instruct.")
    revision: str | None = Field(None, min_length=1, max_length=256,
                                 description="Branch, tag or commit; default main. A commit pins the download.")
    token_secret: str | None = Field(None, min_length=1, max_length=253,
                                     description="Secret holding the Hub token (gated or private repos).")
    token_secret_key: str = Field("HF_TOKEN", min_length=1, max_length=253,
                                  description="Key of the token in tokenSecret.")
    endpoint: str | None = Field(None, min_length=1, max_length=2048, pattern=r"^https?://",
                                 description="Hub endpoint (HF_ENDPOINT): a mirror or a hub proxy.")


class UriSource(_Model):
    url: str = Field(min_length=1, max_length=2048, description="http(s):// URL of a checkpoint archive (.tar, "
                     ".tar.gz, .tgz, .zip) or s3://bucket/prefix (a checkpoint directory or an archive object).")
    credentials_secret: str | None = Field(None, min_length=1, max_length=253, description="Secret whose keys "
                                           "become the download's environment, e.g. AWS_ACCESS_KEY_ID, "
                                           "AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL for an S3-compatible store.")


class ModelSource(_Model):
    """At most one member. None set (or the whole block omitted) means a tiny generated checkpoint, which only
    the local launcher supports. huggingFace and uri are downloaded before the worker starts (an init container
    on Kubernetes) into the model cache."""
    model_config = ConfigDict(json_schema_extra={"maxProperties": 1})
    hugging_face: HuggingFaceSource | None = Field(None, description="Download from the Hugging Face Hub.")
    pvc: PvcSource | None = Field(None, description="Checkpoint on a PVC, mounted read-only at /models.")
    path: str | None = Field(None, min_length=1, max_length=1024,
                             description="Checkpoint directory already inside the image (or a volume).")
    uri: UriSource | None = Field(None, description="Download an archive or an object-store prefix.")

    @model_validator(mode="after")
    def _at_most_one(self) -> ModelSource:
        chosen = [n for n in ("hugging_face", "pvc", "path", "uri") if getattr(self, n) is not None]
        if len(chosen) > 1:
            raise ValueError(f"set at most one model source, got {', '.join(to_camel(n) for n in chosen)}")
        return self

    @property
    def kind(self) -> Literal["generated", "huggingFace", "pvc", "path", "uri"]:
        for name in ("hugging_face", "pvc", "path", "uri"):
            if getattr(self, name) is not None:
                return to_camel(name)  # type: ignore[return-value]
        return "generated"

    @property
    def downloaded(self) -> bool:
        return self.hugging_face is not None or self.uri is not None


class ModelSpec(_Model):
    served_name: str = Field(min_length=1, max_length=256, description="Model name clients send in requests.")
    source: ModelSource = Field(default_factory=ModelSource)
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    max_model_len: int | None = Field(None, ge=16, le=1_048_576, description="Context length in tokens.")
    cache_claim_name: str | None = Field(None, min_length=1, max_length=253, description="PVC for downloaded "
                                         "checkpoints (huggingFace, uri): pods that restart or are added reuse "
                                         "it. Default: an emptyDir per pod. ReadWriteMany when pods share nodes.")


# ---------------------------------------------------------------- kv transfer
# an extended resource a device plugin advertises: "<prefix>/<name>", e.g. rdma/ib, rdma/hca_shared_devices_a
EXTENDED_RESOURCE_PATTERN = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"


class RdmaSpec(_Model):
    """KV transfer over RDMA (InfiniBand/RoCE): UCX registers (pins) the memory it transfers."""
    enabled: bool = Field(False, description="Prefill and decode containers get the IPC_LOCK capability "
                          "(memory registration); off: they get no capability at all.")
    resource_name: str | None = Field(None, max_length=253, pattern=EXTENDED_RESOURCE_PATTERN,
                                      description="RDMA device resource of your device plugin, e.g. rdma/ib: "
                                      "each prefill and decode pod requests and limits 1 (only when enabled).")


class SharedStorageSpec(_Model):
    """The filesystem SharedStorageConnector's workers share on Kubernetes."""
    claim_name: str = Field(min_length=1, max_length=253, description="A ReadWriteMany PVC mounted by every "
                            "prefill and decode pod at /kv-shared.")


class KVTransferSpec(_Model):
    connector: str = Field("NixlConnector", min_length=1, max_length=256,
                           description=f"{', '.join(CONNECTORS)} or 'package.module:Class'.")
    lease_seconds: int = Field(30, ge=1, le=3600,
                               description="Prefill frees KV blocks not read by decode within this time.")
    load_failure_policy: Literal["recompute", "fail"] = "recompute"
    shared_storage: SharedStorageSpec | None = Field(None, description="SharedStorageConnector on Kubernetes.")
    rdma: RdmaSpec = Field(default_factory=RdmaSpec)


# ---------------------------------------------------------------- pod scheduling bits
class Toleration(_Model):
    key: str | None = None
    operator: Literal["Exists", "Equal"] | None = None
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = None


class EnvVar(_Model):
    name: str = Field(min_length=1, max_length=256)
    value: str | None = None
    value_from: _FreeForm | None = None


class Resources(_Model):
    requests: dict[str, Quantity] = Field(default_factory=dict, description="e.g. {cpu: 8, memory: 64Gi}")
    limits: dict[str, Quantity] = Field(default_factory=dict)


class WorkerResources(Resources):
    gpus: int = Field(0, ge=0, le=64, description="nvidia.com/gpu per pod (request = limit).")


class PodPlacement(_Model):
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[Toleration] = Field(default_factory=list)
    affinity: _FreeForm | None = None


class RoleSpec(PodPlacement):
    """A prefill or a decode pool."""
    replicas: int = Field(1, ge=0, le=1000, description="With autoscaling on, only the starting point (moved into "
                          "min/max) when the Deployment is created; then the autoscaler sets its replicas.")
    resources: WorkerResources = Field(default_factory=WorkerResources)
    tensor_parallel_size: int = Field(1, ge=1, le=64)
    env: list[EnvVar] = Field(default_factory=list)
    extra_args: list[str] = Field(default_factory=list, description="Appended to the worker command line.")
    shared_memory_size: Quantity | None = Field(None, description="sizeLimit of the /dev/shm emptyDir.")
    drain_delay_seconds: int = Field(5, ge=0, le=3600,
                                     description="preStop wait so the router stops sending before SIGTERM.")
    termination_grace_period_seconds: int = Field(120, ge=1, le=86400)


class RouterService(_Model):
    type: Literal["ClusterIP", "NodePort", "LoadBalancer"] = "ClusterIP"
    port: int = Field(8000, ge=1, le=65535)


class RouterTimeouts(_Model):
    """Bounds on the router's waits (README: Reliability): past one, a hop fails over, or the client gets a 504
    before anything streamed (an SSE error event once it has)."""
    connect_seconds: int = Field(5, ge=1, le=600, description="Connecting to a worker.")
    first_byte_seconds: int = Field(120, ge=1, le=86400, description="A hop until its first byte: the prefill's "
                                    "answer (queueing + the prompt's compute), a decode stream's first chunk.")
    idle_seconds: int = Field(60, ge=1, le=86400, description="A decode stream's silence between chunks.")
    request_seconds: int = Field(600, ge=1, le=86400, description="A client request, all hops together; the "
                                 "only bound on a non-streamed decode answer.")
    unresponsive_seconds: int | None = Field(
        None, ge=0, le=86400, description="Readiness probes timing out in a row for this long mark a worker hung: "
        "it is taken out and waits on it that streamed nothing yet fail over (0: never). Unset: 8 with engine "
        "disagg, 60 with engine vllm, whose API server answers /health late while its engine and NIXL threads "
        "keep the CPUs busy (27 s measured on 2 cores).")

    def unresponsive_after(self, engine: str) -> float:
        if self.unresponsive_seconds is not None:
            return float(self.unresponsive_seconds)
        return UNRESPONSIVE_AFTER_S.get(engine, UNRESPONSIVE_AFTER_S["disagg"])


# engine -> the default of spec.router.timeouts.unresponsiveSeconds
UNRESPONSIVE_AFTER_S = {"disagg": router_endpoints.UNRESPONSIVE_AFTER_S, "vllm": 60.0}


class OutlierDetection(_Model):
    """Worker endpoints whose hops fail are left out for a while, then re-probed."""
    consecutive_failures: int = Field(2, ge=1, le=100, description="Failed hops in a row that eject an endpoint "
                                      "(a timed-out hop ejects at once).")
    base_ejection_seconds: int = Field(5, ge=1, le=3600, description="The first ejection; each further one in a "
                                       "row doubles it.")
    max_ejection_seconds: int = Field(300, ge=1, le=86400)


class PrefixAwareRouting(_Model):
    """How policy prefix-aware weighs a worker's cached prefix against its load (router/prefix_policy.py)."""
    load_cost_tokens: int = Field(
        int(PrefixPolicyConfig.load_cost_tokens), ge=0, le=1_000_000, description="One request in flight at a "
        "worker weighs as much as this many prompt tokens it would have to compute: lower packs a hot prefix "
        "onto the worker that holds it, higher spreads load sooner.")
    skip_prefill_blocks: int = Field(
        PrefixPolicyConfig.skip_prefill_max_missing_blocks, ge=0, le=100_000, description="Send a prompt to "
        "decode alone (no prefill hop, no KV transfer) when the chosen decode worker misses at most this many "
        "full KV blocks of it (0: only when it holds them all).")


class RouterSpec(PodPlacement):
    replicas: int = Field(1, ge=0, le=100)
    policy: Literal[POLICY_NAMES] = Field(  # the router's registry (router/policies.py)
        DEFAULT_POLICY, description="prefix-aware: by the workers' KV-cache events, the endpoint with the longest "
        "cached prefix of the prompt, weighed against load (turns the workers' events on).")
    service: RouterService = Field(default_factory=RouterService)
    resources: Resources = Field(default_factory=Resources)
    timeouts: RouterTimeouts = Field(default_factory=RouterTimeouts)
    outlier_detection: OutlierDetection = Field(default_factory=OutlierDetection)
    prefix_aware: PrefixAwareRouting = Field(default_factory=PrefixAwareRouting)
    extra_args: list[str] = Field(default_factory=list)

    def bound_args(self, engine: str) -> list[str]:
        """The `disagg router` flags for the timeouts, outlier detection and prefix-aware weights (pods and
        `disagg up` alike)."""
        t, o, x = self.timeouts, self.outlier_detection, self.prefix_aware
        return ["--connect-timeout", str(t.connect_seconds), "--first-byte-timeout", str(t.first_byte_seconds),
                "--idle-timeout", str(t.idle_seconds), "--request-timeout", str(t.request_seconds),
                "--unresponsive-after", f"{t.unresponsive_after(engine):g}",
                "--eject-after-failures", str(o.consecutive_failures),
                "--ejection-seconds", str(o.base_ejection_seconds),
                "--max-ejection-seconds", str(o.max_ejection_seconds),
                "--prefix-load-cost-tokens", str(x.load_cost_tokens),
                "--prefix-skip-prefill-blocks", str(x.skip_prefill_blocks)]


# ---------------------------------------------------------------- autoscaling (policy lives in autoscaling/)
class ReplicaBounds(_Model):
    min_replicas: int = Field(1, ge=0, le=1000)
    max_replicas: int = Field(4, ge=1, le=1000)


class MetricsSource(_Model):
    """scrape: GET http://<podIP>:<port>/metrics of every ready prefill/decode pod, port 8000 unless the pod has
    the annotation disagg.dev/metrics-port. prometheus: instant queries against prometheusUrl."""
    type: Literal["scrape", "prometheus"] = "scrape"
    prometheus_url: str | None = Field(None, max_length=2048)
    timeout_seconds: int = Field(5, ge=1, le=60)
    selector: str | None = Field(None, max_length=1024,
                                 description='prometheus: extra PromQL label matchers, e.g. namespace="ml"')
    pod_label: str = Field("pod", min_length=1, max_length=253,
                           description="prometheus: the series label that holds the pod name.")


class PrefillTargets(_Model):
    waiting_requests_per_pod: int | None = Field(4, ge=1, description="vllm:num_requests_waiting per pod.")
    waiting_prompt_tokens_per_pod: int | None = Field(None, ge=1,
                                                      description="disagg:num_waiting_prompt_tokens per pod.")
    time_to_first_token_milliseconds: int | None = Field(None, ge=1)
    utilization_percent: int = Field(100, ge=1, le=100, description="With scaleUpLookaheadSeconds: size prefill "
                                     "for this share of each pod's measured prompt throughput (headroom).")


class DecodeTargets(_Model):
    kv_cache_usage_percent: int | None = Field(80, ge=1, le=100)
    inter_token_latency_milliseconds: int | None = Field(None, ge=1)


class TransferTargets(_Model):
    kv_transfer_time_milliseconds: int | None = Field(None, ge=1)
    pending_loads_per_pod: int | None = Field(None, ge=1, description="disagg:kv_pending_loads per decode pod.")
    pending_sends_per_pod: int = Field(2, ge=1, description="disagg:kv_pending_sends per prefill pod above which "
                                       "KV waits to be pulled: decode (not prefill) is short.")


class ScalingTargets(_Model):
    prefill: PrefillTargets = Field(default_factory=PrefillTargets)
    decode: DecodeTargets = Field(default_factory=DecodeTargets)
    transfer: TransferTargets = Field(default_factory=TransferTargets)


class Stabilization(_Model):
    scale_up_seconds: int = Field(0, ge=0, le=3600)
    scale_down_seconds: int = Field(300, ge=0, le=3600)
    scale_up_lookahead_seconds: int = Field(0, ge=0, le=3600, description="The pods' start-up time. Not-ready "
                                            "pods count as capacity on the way, and scale-up acts on demand "
                                            "projected this far ahead; 0 reacts to current load only.")


class ReplicaRatio(_Model):
    """prefill:decode as an integer pair, e.g. 1:4."""
    prefill: int = Field(ge=1, le=1000)
    decode: int = Field(ge=1, le=1000)


class PrefillDecodeRatio(_Model):
    min: ReplicaRatio | None = None
    max: ReplicaRatio | None = None


class AutoscalingSpec(_Model):
    enabled: bool = False
    dry_run: bool = Field(False, description="Decide and report in status, change nothing.")
    interval_seconds: int = Field(15, ge=1, le=3600)
    metrics_source: MetricsSource = Field(default_factory=MetricsSource)
    prefill: ReplicaBounds = Field(default_factory=ReplicaBounds)
    decode: ReplicaBounds = Field(default_factory=ReplicaBounds)
    targets: ScalingTargets = Field(default_factory=ScalingTargets)
    tolerance_percent: int = Field(10, ge=0, le=100, description="No change while |desired/current-1| is within.")
    stabilization: Stabilization = Field(default_factory=Stabilization)
    max_step_per_interval: int = Field(1, ge=1, le=100, description="Most replicas added/removed per role per step.")
    max_step_percent_per_interval: int | None = Field(None, ge=1, le=1000, description="Scale-up may also add "
                                                      "this percentage of the current replicas per step.")
    prefill_decode_ratio: PrefillDecodeRatio = Field(default_factory=PrefillDecodeRatio)
    latency_statistic: Literal["Percentile", "Mean"] = Field(
        "Percentile", description="How TTFT, ITL and transfer-time histograms of one interval become one number.")
    latency_percentile: int = Field(90, ge=1, le=99, description="The percentile when latencyStatistic is "
                                    "Percentile.")
    stale_after_seconds: int | None = Field(None, ge=1, le=86400, description="A pod's sample older than this "
                                            "holds scaling; default 3 x intervalSeconds + metricsSource."
                                            "timeoutSeconds.")


# ---------------------------------------------------------------- the spec
Engine = Literal["disagg", "vllm"]
ENGINES: tuple[str, ...] = get_args(Engine)
# connectors each engine can run; vLLM's workers speak our kv_transfer_params protocol through its NixlConnector
VLLM_CONNECTORS = ("NixlConnector",)


class DisaggregatedInferenceSpec(_Model):
    model: ModelSpec
    engine: Engine = Field("disagg", description="What runs in prefill and decode pods: disagg (the built-in "
                           "worker, `disagg worker`) or vllm (`vllm serve` with vLLM's NixlConnector). One field "
                           "for both roles: KV layouts differ between engines, so they never mix.")
    engine_args: list[str] = Field(default_factory=list, description="Passed to both roles' engine command "
                                   "(`disagg worker` or `vllm serve`) before each role's extraArgs, e.g. "
                                   "[--max-num-seqs, '64'].")
    image: str | None = Field(None, min_length=1, max_length=512,
                              description="Image with `disagg` (router, model download; the workers when engine "
                              "is disagg); required on Kubernetes.")
    engine_image: str | None = Field(None, min_length=1, max_length=512, description="engine vllm: the prefill "
                                     "and decode containers' image (`vllm` on PATH, e.g. a vllm-openai image); "
                                     "default image.")
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] | None = None
    image_pull_secrets: list[str] = Field(default_factory=list)
    kv_transfer: KVTransferSpec = Field(default_factory=KVTransferSpec)
    prefill: RoleSpec = Field(default_factory=RoleSpec)
    decode: RoleSpec = Field(default_factory=RoleSpec)
    router: RouterSpec = Field(default_factory=RouterSpec)
    autoscaling: AutoscalingSpec = Field(default_factory=AutoscalingSpec)


# ---------------------------------------------------------------- status
# conditions the reconcile pass owns, and those the autoscaler owns
ReconcileCondition = Literal["Ready", "Progressing", "Degraded"]
AutoscalingCondition = Literal["ScalingActive", "ScalingLimited", "TransferBound"]
RECONCILE_CONDITIONS: tuple[str, ...] = get_args(ReconcileCondition)
AUTOSCALING_CONDITIONS: tuple[str, ...] = get_args(AutoscalingCondition)


class Condition(_Model):
    type: Literal[ReconcileCondition, AutoscalingCondition]
    status: Literal["True", "False", "Unknown"]
    reason: str = Field(pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$", max_length=1024)
    message: str = Field("", max_length=32768)
    last_transition_time: str | None = Field(None, json_schema_extra={"format": "date-time"})
    observed_generation: int | None = Field(None, ge=0)


class RoleStatus(_Model):
    replicas: int = 0  # pods that exist (any revision)
    ready_replicas: int = 0  # pods passing /ready
    updated_replicas: int = 0  # pods on the current pod template


class RoleScaling(_Model):
    current: int = Field(0, ge=0, description="Deployment replicas when the autoscaler last decided.")
    desired: int = Field(0, ge=0, description="What the autoscaler wants; the operator applies it (not in dryRun).")
    reason: str = Field("", max_length=256, description="One CamelCase word, e.g. DecodeBound, Underutilized.")
    limited_by: str | None = Field(None, max_length=256, description="TooFewReplicas, TooManyReplicas, "
                                   "StepLimited or RatioBound.")
    signals_used: list[str] = Field(default_factory=list, description="The signals this decision read, e.g. "
                                    "kvCacheUsage, pendingLoads.")
    signals_unavailable: list[str] = Field(default_factory=list, description="Signals no pod exported (vLLM "
                                           "workers lack the disagg: gauges); the decision worked without them.")


class ScalingDecision(_Model):
    """The last decision that changed (or, in dryRun, would change) a pool's replicas."""
    time: str = Field(json_schema_extra={"format": "date-time"})
    role: Literal["prefill", "decode"]
    from_: int = Field(ge=0, alias="from")
    to: int = Field(ge=0)
    reason: str = Field(max_length=256)
    bottleneck: str | None = Field(None, max_length=256)
    dry_run: bool = False
    metrics: dict[str, str] = Field(default_factory=dict, description="The values compared with the targets, "
                                    "as decimal strings; units in the names.")


class AutoscalingStatus(_Model):
    dry_run: bool = Field(False, description="The decisions below were reported, not applied.")
    prefill: RoleScaling | None = None
    decode: RoleScaling | None = None
    last_decision: ScalingDecision | None = None


class DisaggregatedInferenceStatus(_Model):
    observed_generation: int | None = None
    revision: str | None = Field(None, description="Serving revision; the router pairs pods of one revision.")
    endpoint: str | None = Field(None, description="Router URL inside the cluster.")
    prefill: RoleStatus | None = None
    decode: RoleStatus | None = None
    router: RoleStatus | None = None
    conditions: list[Condition] = Field(default_factory=list)
    autoscaling: AutoscalingStatus | None = None


# ---------------------------------------------------------------- parsing and checks beyond the schema
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


def parse_spec(spec: dict[str, Any]) -> DisaggregatedInferenceSpec:
    """Raises pydantic.ValidationError; see pydantic_problems()."""
    return DisaggregatedInferenceSpec.model_validate(spec)


def check_spec(raw: Any,
               target: Literal["kubernetes", "local"]) -> tuple[DisaggregatedInferenceSpec | None, list[Problem]]:
    """Parse and check a spec: (the spec, []) when it can be served on `target`; else the problems, schema
    (pydantic) ones first; the checks beyond the schema only run on a spec that parsed (the spec is None
    when it did not)."""
    try:
        spec = parse_spec(raw)
    except ValidationError as e:
        return None, pydantic_problems(e)
    return spec, semantic_problems(spec, target)


def semantic_problems(spec: DisaggregatedInferenceSpec, target: Literal["kubernetes", "local"]) -> list[Problem]:
    """What the schema accepts but cannot be served. `target` adds what only Kubernetes needs."""
    problems: list[Problem] = []
    if (why := connector_problem(spec.kv_transfer.connector)) is not None:
        problems.append(Problem("spec.kvTransfer.connector", why))
    problems += _model_problems(spec) + _parallel_problems(spec) + _engine_problems(spec)
    a = spec.autoscaling
    for role in ("prefill", "decode"):
        bounds: ReplicaBounds = getattr(a, role)
        if bounds.min_replicas > bounds.max_replicas:
            problems.append(Problem(f"spec.autoscaling.{role}.minReplicas",
                                    f"minReplicas {bounds.min_replicas} > maxReplicas {bounds.max_replicas}"))
    lo, hi = a.prefill_decode_ratio.min, a.prefill_decode_ratio.max
    if lo and hi and lo.prefill * hi.decode > hi.prefill * lo.decode:  # lo.p/lo.d > hi.p/hi.d without floats
        problems.append(Problem("spec.autoscaling.prefillDecodeRatio",
                                f"min {lo.prefill}:{lo.decode} is above max {hi.prefill}:{hi.decode}"))
    problems += _router_problems(spec.router)
    if a.metrics_source.type == "prometheus" and not a.metrics_source.prometheus_url:
        problems.append(Problem("spec.autoscaling.metricsSource.prometheusUrl", "required when type is prometheus"))
    rdma = spec.kv_transfer.rdma
    for role in ("prefill", "decode"):
        r: RoleSpec = getattr(spec, role)
        if rdma.enabled and rdma.resource_name and \
                rdma.resource_name in {*r.resources.requests, *r.resources.limits}:
            problems.append(Problem(f"spec.{role}.resources",
                                    f"{rdma.resource_name} is requested by kvTransfer.rdma.resourceName already "
                                    "(1 per pod): remove it here"))
        if r.drain_delay_seconds >= r.termination_grace_period_seconds:
            problems.append(Problem(f"spec.{role}.drainDelaySeconds",
                                    f"{r.drain_delay_seconds} must be below terminationGracePeriodSeconds "
                                    f"{r.termination_grace_period_seconds}"))
    from disagg.operator.worker_command import command_problems  # it builds commands from these models

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


def _router_problems(r: RouterSpec) -> list[Problem]:
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


def _model_problems(spec: DisaggregatedInferenceSpec) -> list[Problem]:
    uri = spec.model.source.uri
    if uri is None:
        return []
    scheme = uri.url.partition("://")[0].lower() if "://" in uri.url else ""
    if scheme not in URI_SCHEMES:
        return [Problem("spec.model.source.uri.url", f"scheme {scheme + '://' if scheme else '(none)'} in "
                        f"{uri.url!r} is not supported: use {', '.join(s + '://' for s in URI_SCHEMES)}")]
    if scheme == "s3" and not uri.url[len("s3://"):].split("/")[0]:
        return [Problem("spec.model.source.uri.url", f"{uri.url!r}: expected s3://bucket[/prefix]")]
    return []


def _parallel_problems(spec: DisaggregatedInferenceSpec) -> list[Problem]:
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


def _engine_problems(spec: DisaggregatedInferenceSpec) -> list[Problem]:
    if spec.engine == "vllm" and spec.kv_transfer.connector not in VLLM_CONNECTORS:
        return [Problem("spec.kvTransfer.connector",
                        f"{spec.kv_transfer.connector} does not run with engine vllm: use "
                        f"{', '.join(VLLM_CONNECTORS)} (vLLM's own, which speaks the router's KV protocol)")]
    return []


def worker_gpus(spec: DisaggregatedInferenceSpec, role: str) -> int:
    """nvidia.com/gpu per pod: resources.gpus; with engine vllm at least tensorParallelSize when above 1."""
    r: RoleSpec = getattr(spec, role)
    if spec.engine == "vllm" and r.tensor_parallel_size > 1:
        return max(r.resources.gpus, r.tensor_parallel_size)
    return r.resources.gpus


def request_drain_seconds(spec: DisaggregatedInferenceSpec, role: str) -> int:
    """What a pod's grace period leaves for running requests: after the preStop wait, and before the lease
    during which a prefill pod waits for its unread KV to be pulled (the worker's SIGTERM drain)."""
    r: RoleSpec = getattr(spec, role)
    return r.termination_grace_period_seconds - r.drain_delay_seconds - spec.kv_transfer.lease_seconds


def _grace_problems(spec: DisaggregatedInferenceSpec) -> list[Problem]:
    problems = []
    for role in ("prefill", "decode"):
        r: RoleSpec = getattr(spec, role)
        if r.drain_delay_seconds < r.termination_grace_period_seconds \
                and request_drain_seconds(spec, role) < MIN_REQUEST_DRAIN_SECONDS:
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
