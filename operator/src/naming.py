"""The names and numbers the operator's children, the router and `disagg up` agree on: the API group, the labels
and annotations, the children's names, the pods' fixed ports, the KV-events topic, and the hash that stamps
templates and cache directories.

Standard library only: the router (worker image) reads LABEL_REVISION from here - the label the operator sets on
worker pods is the contract between the two.
"""
from __future__ import annotations

import hashlib
import json
from typing import Any, Literal

GROUP = "disagg.dev"  # the CRD's API group; our labels and annotations live under it

# what a child is part of: the pools, the router, the gateway's endpoint picker (epp) and the objects the gateway
# reads (gateway: the InferencePool, the HTTPRoute), the decode pods' identity behind a gateway (worker: their
# ServiceAccount) and the signed hand-off's key (handoff: its Secret)
Component = Literal["prefill", "decode", "router", "epp", "gateway", "worker", "handoff"]

# labels of every child (Kubernetes' recommended ones); the selector is name + instance + component
LABEL_NAME = "app.kubernetes.io/name"
LABEL_INSTANCE = "app.kubernetes.io/instance"  # the DisaggregatedInference's name
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_REVISION = f"{GROUP}/revision"  # serving revision on worker pods; the router pairs prefill and decode by it
APP_NAME = "disagg"
MANAGED_BY = "disagg-operator"

ANNOTATION_CONFIG_HASH = f"{GROUP}/config-hash"  # on pod templates: a change rolls the pods
ANNOTATION_LAST_APPLIED = f"{GROUP}/last-applied"  # JSON of what the operator last wrote to the child
ANNOTATION_METRICS_PORT = f"{GROUP}/metrics-port"  # on a pod: where the autoscaler scrapes /metrics (default HTTP)
ANNOTATION_DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"  # the ReplicaSet removes low costs first

# the worker pods' fixed ports (`disagg up` hands out free ones instead)
HTTP_PORT = 8000  # API, /health, /ready, /metrics; the router pod's too
SIDE_CHANNEL_PORT = 5600  # NIXL side channel
KV_EVENTS_PORTS = (5557, 5558)  # KV-cache events PUB and replay (router.policy prefix-aware)
ENGINE_PORT = 8001  # engine vllm: vLLM on the pod's loopback, behind `disagg pd-proxy` (which owns HTTP_PORT)
EPP_GRPC_PORT = 9002  # the endpoint picker's ext_proc (GIE's conventional port)
EPP_HEALTH_PORT = 9003  # its gRPC health service
EPP_METRICS_PORT = 9090  # its HTTP /health, /ready, /metrics
KV_EVENTS_TOPIC = "kv-events"  # engine vllm: the topic frame of its KV-cache events (the router subscribes to it)

# children are named "<name>-prefill", "<name>-decode", "<name>-handoff" (the longest suffixes), ...: a 63-char
# DNS label minus the suffix
MAX_NAME_LENGTH = 55


def child_name(instance: str, component: Component) -> str:
    return f"{instance}-{component}"


def selector_labels(instance: str, component: Component) -> dict[str, str]:
    return {LABEL_NAME: APP_NAME, LABEL_INSTANCE: instance, LABEL_COMPONENT: component}


def label_selector(instance: str, component: Component) -> str:
    return ",".join(f"{k}={v}" for k, v in selector_labels(instance, component).items())


def common_labels(instance: str, component: Component) -> dict[str, str]:
    return {**selector_labels(instance, component), LABEL_MANAGED_BY: MANAGED_BY}


def stable_hash(obj: Any, length: int = 16) -> str:
    """A hash of a JSON-able object that does not depend on key order (templates, model sources)."""
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:length]
