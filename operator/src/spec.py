"""DisaggregatedInference spec and status: the single source of truth for the CRD schema, the operator,
`disagg validate` and the local launcher (`disagg up`).

Kubernetes API conventions: camelCase names, integers (never floats), units in names (`leaseSeconds`),
conditions + observedGeneration in status, no `phase`.

Over 300 lines on purpose: the whole resource (spec and status) reads top to bottom in one file, the way
`kubectl explain` shows it; each model is a few lines. The models import none of the builders: the checks beyond
the schema (cross-field, per target, every command parsed) are in checks.py.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator
from pydantic.alias_generators import to_camel

from disagg.operator.naming import GROUP
from disagg.worker.body_limit import DEFAULT_MAX_BODY_BYTES
from disagg.worker.kv_transfer.connectors import CONNECTORS
from disagg.worker.router import endpoints as router_endpoints
from disagg.worker.router.policies import DEFAULT_POLICY, POLICY_NAMES
from disagg.worker.router.prefix_policy import PrefixPolicyConfig
from disagg.worker.router.waiting_room import DEFAULT_QUEUE_WAIT_S

VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "DisaggregatedInference"
PLURAL = "disaggregatedinferences"
SINGULAR = "disaggregatedinference"
SHORT_NAMES = ["dinf"]

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


class Admission(_Model):
    """What a worker takes on before it answers 429 with Retry-After (README: Reliability, overload)."""
    max_waiting_requests: int | None = Field(
        None, ge=0, le=1_000_000, description="Requests queued beyond the running batch. Unset: the batch size "
        "(--max-num-seqs), an eighth of it on decode workers. Engine disagg; vLLM's queue is its own.")
    max_waiting_prompt_tokens: int | None = Field(
        None, ge=0, le=100_000_000, description="Prompt tokens queued to compute (a request alone is always "
        "queued). Unset: 8 x --max-num-batched-tokens. Engine disagg.")
    max_request_body_bytes: int = Field(DEFAULT_MAX_BODY_BYTES, ge=1, le=2**31, description="Larger request "
                                        "bodies are answered 413 (by the worker, or vLLM's pd-proxy).")


class RoleSpec(PodPlacement):
    """A prefill or a decode pool."""
    replicas: int = Field(1, ge=0, le=1000, description="With autoscaling on, only the starting point (moved into "
                          "min/max) when the Deployment is created; then the autoscaler sets its replicas.")
    resources: WorkerResources = Field(default_factory=WorkerResources)
    tensor_parallel_size: int = Field(1, ge=1, le=64)
    env: list[EnvVar] = Field(default_factory=list)
    extra_args: list[str] = Field(default_factory=list, description="Appended to the worker command line.")
    admission: Admission = Field(default_factory=Admission)
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


class RouterAuth(_Model):
    """Client API keys: a request without `Authorization: Bearer <the key>` gets 401 (/health, /ready and /metrics
    stay open to probes). The same key at the endpoint picker behind a gateway."""
    secret_name: str = Field(min_length=1, max_length=253, description="A Secret in this resource's namespace.")
    key: str = Field("api-key", min_length=1, max_length=253, description="Its entry holding the key.")


class RouterTLS(_Model):
    """HTTPS on the router: the certificate and key of a kubernetes.io/tls Secret (tls.crt, tls.key)."""
    secret_name: str = Field(min_length=1, max_length=253, description="A kubernetes.io/tls Secret in this "
                             "resource's namespace, mounted read-only into the router pods.")


class RouterAdmission(_Model):
    """Load shedding at the router (README: Reliability, overload)."""
    queue_wait_seconds: float = Field(DEFAULT_QUEUE_WAIT_S, ge=0, le=60, description="With every decode worker "
                                      "at capacity (answering 429), how long a request waits for room before "
                                      "it is answered 429 with Retry-After (0: at once).")
    max_request_body_bytes: int = Field(DEFAULT_MAX_BODY_BYTES, ge=1, le=2**31,
                                        description="Larger request bodies are answered 413.")
    max_in_flight_per_endpoint: int | None = Field(
        None, ge=0, le=100_000, description="Generation requests one router serves at once, per ready decode "
        "worker (and 500 in all); more are answered 429 with Retry-After before their body is parsed. Unset, "
        "engine disagg: what a decode worker takes at once - its --max-num-seqs (engineArgs or decode.extraArgs; "
        "else 64) plus its waiting queue (decode.admission.maxWaitingRequests, else an eighth of that); engine "
        "vllm: 0, since vLLM's waiting queue has no bound. 0: no bound per worker.")


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
    auth: RouterAuth | None = Field(None, description="Client API keys (default: none; anyone who reaches the "
                                    "router may use it).")
    tls: RouterTLS | None = Field(None, description="Serve HTTPS (default: plain HTTP).")
    admission: RouterAdmission = Field(default_factory=RouterAdmission)
    extra_args: list[str] = Field(default_factory=list)


# ---------------------------------------------------------------- gateway (Gateway API Inference Extension)
FailureMode = Literal["FailOpen", "FailClose"]


class EndpointPickerSpec(_Model):
    """The endpoint picker (`disagg epp`): the router's policy, timeouts, outlier detection and prefix-aware
    weights (spec.router) picking for the gateway."""
    replicas: int = Field(1, ge=0, le=100)
    resources: Resources = Field(default_factory=Resources)
    extra_args: list[str] = Field(default_factory=list, description="Appended to `disagg epp`'s command line.")


class HTTPRouteSpec(_Model):
    """An HTTPRoute (gateway.networking.k8s.io/v1) from your Gateway to this resource's InferencePool."""
    gateway_name: str = Field(min_length=1, max_length=253, description="The Gateway the route attaches to.")
    gateway_namespace: str | None = Field(None, min_length=1, max_length=63, description="Its namespace; "
                                          "default this resource's (another one must allow the route).")
    section_name: str | None = Field(None, min_length=1, max_length=253,
                                     description="A listener of that Gateway; default all of them.")
    hostnames: list[Annotated[str, StringConstraints(min_length=1, max_length=253)]] = Field(
        default_factory=list, max_length=16, description="Host names the route matches; default any.")
    path_prefix: str = Field("/", min_length=1, max_length=1024, pattern=r"^/",
                             description="Requests under this path go to the pool.")


class GatewaySpec(_Model):
    """Serve behind a Gateway API inference gateway (Envoy, kgateway, Istio, GKE Gateway): an InferencePool of
    the decode pods, our endpoint picker and, with httpRoute, a route from your Gateway. The router stays."""
    enabled: bool = Field(False, description="Render the InferencePool, the endpoint picker and the decode "
                          "pods' prefill hop (decode pods then list pods: a ServiceAccount of their own).")
    failure_mode: FailureMode = Field("FailClose", description="When the gateway cannot reach the picker: "
                                      "FailClose answers 503, FailOpen sends to any pool pod (decode alone).")
    endpoint_picker: EndpointPickerSpec = Field(default_factory=EndpointPickerSpec)
    http_route: HTTPRouteSpec | None = Field(None, description="Attach the pool to your Gateway.")


# ---------------------------------------------------------------- security
class SecretKeySelector(_Model):
    name: str = Field(min_length=1, max_length=253, description="A Secret in this resource's namespace.")
    key: str = Field("key", min_length=1, max_length=253)


class NetworkPolicySpec(_Model):
    """Ingress NetworkPolicies for this resource's pods: workers reachable only from its router, endpoint picker
    and its own workers (plus gatewayFrom and metricsFrom), the router from anywhere."""
    enabled: bool = True
    gateway_from: list[_FreeForm] | None = Field(
        None, description="NetworkPolicyPeers where your gateway's proxies run: they may reach the decode pods "
        "and the endpoint picker. Unset: any pod of any namespace; [] nobody.")
    metrics_from: list[_FreeForm] | None = Field(
        None, description="NetworkPolicyPeers that scrape the workers' /metrics (the operator's autoscaler, "
        "Prometheus). Unset: pods labelled app.kubernetes.io/name=disagg-operator in any namespace.")


class SecuritySpec(_Model):
    handoff_key_secret: SecretKeySelector | None = Field(
        None, description="Your Secret holding the key that signs P/D hand-offs (base64 of >= 16 random bytes). "
        "Unset: the operator creates <name>-handoff once and never rewrites it.")
    network_policy: NetworkPolicySpec = Field(default_factory=NetworkPolicySpec)


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


class ScaleToZero(_Model):
    """Both pools to zero after idleSeconds with nothing in flight or waiting anywhere (decode last, drained as any
    scale-down); back at once when the router holds a request. The router holds requests while no decode pod is
    ready: at most holdSeconds each (then 503 with Retry-After), maxHeldRequests at once (then 429)."""
    enabled: bool = Field(False, description="Off by default: a pool whose minReplicas is 0 then only loses its "
                          "last pod by the policy (prefill at 0: decode serves alone).")
    idle_seconds: int = Field(300, ge=1, le=86400, description="No request running, waiting, held or with KV "
                              "pending in the resource for this long takes both pools to 0.")
    hold_seconds: int = Field(120, ge=1, le=3600, description="How long the router holds a request no decode pod "
                              "is ready for (cover the pods' start-up: model load, image pull).")
    max_held_requests: int = Field(100, ge=1, le=100000, description="Requests held at once per router pod.")


class AutoscalingSpec(_Model):
    enabled: bool = False
    mode: Literal["builtin", "external"] = Field(
        "builtin", description="Who owns the worker pools' replicas while enabled: builtin (this operator's "
        "policy) or external (an HPA, KEDA or any writer of this resource's /scale subresource, which is "
        "spec.decode.replicas; prefill follows it into prefillDecodeRatio and prefill's min/max, and the "
        "operator's policy stays off).")
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
    scale_to_zero: ScaleToZero = Field(default_factory=ScaleToZero)

    def builtin(self) -> bool:
        """This operator's policy decides the replicas (mode external: someone else, through /scale)."""
        return self.enabled and self.mode == "builtin"

    def holds_requests(self) -> bool:
        """The router holds requests while no decode pod is ready: the pools may be at zero."""
        return self.enabled and self.scale_to_zero.enabled


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
    gateway: GatewaySpec = Field(default_factory=GatewaySpec)
    security: SecuritySpec = Field(default_factory=SecuritySpec)


# ---------------------------------------------------------------- status
# conditions the reconcile pass owns, and those the autoscaler owns
# InferencePoolReady (gateway on): the parents' Accepted and ResolvedRefs, as the user's gateway controller wrote them
ReconcileCondition = Literal["Ready", "Progressing", "Degraded", "InferencePoolReady"]
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
    selector: str | None = None  # the pods' label selector (the /scale subresource's, for an HPA)


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


class ScaleToZeroStatus(_Model):
    """spec.autoscaling.scaleToZero: whether the pools are at zero, why, and when they went and came back."""
    at_zero: bool = Field(False, description="Both pools are (being taken) at zero replicas.")
    reason: str | None = Field(None, max_length=1024, description="Why they are at zero, e.g. how long nothing "
                               "was in flight.")
    since: str | None = Field(None, json_schema_extra={"format": "date-time"}, description="When they went to "
                              "zero.")
    left_zero_at: str | None = Field(None, json_schema_extra={"format": "date-time"}, description="When held "
                                     "requests last brought them back.")
    held_requests: int = Field(0, ge=0, description="Requests the routers held at the last decision.")


class AutoscalingStatus(_Model):
    dry_run: bool = Field(False, description="The decisions below were reported, not applied.")
    prefill: RoleScaling | None = None
    decode: RoleScaling | None = None
    last_decision: ScalingDecision | None = None
    scale_to_zero: ScaleToZeroStatus | None = None


class DisaggregatedInferenceStatus(_Model):
    observed_generation: int | None = None
    revision: str | None = Field(None, description="Serving revision; the router pairs pods of one revision.")
    endpoint: str | None = Field(None, description="Router URL inside the cluster.")
    prefill: RoleStatus | None = None
    decode: RoleStatus | None = None
    router: RoleStatus | None = None
    endpoint_picker: RoleStatus | None = None  # spec.gateway.enabled
    conditions: list[Condition] = Field(default_factory=list)
    autoscaling: AutoscalingStatus | None = None


# ---------------------------------------------------------------- parsing and derived values
def parse_spec(spec: dict[str, Any]) -> DisaggregatedInferenceSpec:
    """Raises pydantic.ValidationError; checks.check_spec() turns it into problems."""
    return DisaggregatedInferenceSpec.model_validate(spec)


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
