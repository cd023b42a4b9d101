"""What every child of a resource shares, whichever builder makes it: the owner reference, metadata and labels,
the pods' security contexts, probes, the /tmp volume, resources and scheduling fields, the stamped pod template,
and the ServiceAccount/Role/RoleBinding of a pod that lists pods (the router, the endpoint picker, decode pods
behind a gateway). Pure: no API calls.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from disagg.operator import spec as s
from disagg.operator.naming import ANNOTATION_CONFIG_HASH, Component, child_name, common_labels, stable_hash
from disagg.worker.api_keys import CLIENT_KEY_ENV

TMP_DIR = "/tmp"  # emptyDir: the root filesystem is read-only
RBAC_API = "rbac.authorization.k8s.io/v1"


@dataclass(frozen=True)
class Owner:
    """The DisaggregatedInference the children belong to."""
    name: str
    namespace: str
    uid: str

    def reference(self) -> dict[str, Any]:
        return {"apiVersion": s.API_VERSION, "kind": s.KIND, "name": self.name, "uid": self.uid,
                "controller": True, "blockOwnerDeletion": True}


def metadata(owner: Owner, name: str, component: Component) -> dict[str, Any]:
    return {"name": name, "namespace": owner.namespace, "labels": common_labels(owner.name, component),
            "ownerReferences": [owner.reference()]}


def downward_env() -> list[dict[str, Any]]:
    def field(path: str) -> dict[str, Any]:
        return {"fieldRef": {"fieldPath": path}}
    return [{"name": "POD_IP", "valueFrom": field("status.podIP")},
            {"name": "POD_NAME", "valueFrom": field("metadata.name")},
            {"name": "POD_NAMESPACE", "valueFrom": field("metadata.namespace")}]


def resources(res: s.Resources, extended: dict[str, int] | None = None) -> dict[str, Any]:
    """`extended`: device-plugin resources (GPUs, RDMA devices) -> count; their request must equal the limit."""
    out: dict[str, Any] = {}
    requests = {k: str(v) for k, v in res.requests.items()}
    limits = {k: str(v) for k, v in res.limits.items()}
    for name, count in (extended or {}).items():
        if count:
            requests[name] = limits[name] = str(count)
    if requests:
        out["requests"] = requests
    if limits:
        out["limits"] = limits
    return out


def scheduling(p: s.PodPlacement) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if p.node_selector:
        out["nodeSelector"] = dict(p.node_selector)
    if p.tolerations:
        out["tolerations"] = [t.model_dump(by_alias=True, exclude_none=True) for t in p.tolerations]
    if p.affinity is not None:
        out["affinity"] = p.affinity.model_dump(by_alias=True)
    return out


def pod_security_context() -> dict[str, Any]:
    """Every pod: the image's non-root user (UID 10001 in the Dockerfile), the runtime's default seccomp profile."""
    return {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}


def container_security_context(add: tuple[str, ...] = ()) -> dict[str, Any]:
    """No capabilities but `add`, no privilege escalation, a read-only root filesystem: the worker and the router
    write only to mounted volumes (/tmp, /dev/shm, the model cache)."""
    capabilities: dict[str, Any] = {"drop": ["ALL"]}
    if add:
        capabilities["add"] = list(add)
    return {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "capabilities": capabilities}


def tmp_volume() -> tuple[dict[str, Any], dict[str, Any]]:
    """(volume, mount) of the writable /tmp."""
    return {"name": "tmp", "emptyDir": {}}, {"name": "tmp", "mountPath": TMP_DIR}


def http_probe(path: str, period: int, failures: int, scheme: str = "HTTP") -> dict[str, Any]:
    get = {"path": path, "port": "http", **({"scheme": scheme} if scheme != "HTTP" else {})}
    return {"httpGet": get, "periodSeconds": period, "failureThreshold": failures, "timeoutSeconds": 5}


def client_key_env(router: s.RouterSpec) -> list[dict[str, Any]]:
    """spec.router.auth: the client API key the router and the endpoint picker accept ($DISAGG_API_KEY)."""
    if router.auth is None:
        return []
    ref = {"name": router.auth.secret_name, "key": router.auth.key}
    return [{"name": CLIENT_KEY_ENV, "valueFrom": {"secretKeyRef": ref}}]


def grpc_probe(port: int, service: str, period: int, failures: int) -> dict[str, Any]:
    """gRPC health checking (Kubernetes >= 1.27): `service` is the name the server reports on."""
    return {"grpc": {"port": port, "service": service}, "periodSeconds": period, "failureThreshold": failures,
            "timeoutSeconds": 5}


def pull_fields(spec: s.DisaggregatedInferenceSpec, container: dict[str, Any], pod_spec: dict[str, Any]) -> None:
    """spec.imagePullPolicy on the container, spec.imagePullSecrets on the pod."""
    if spec.image_pull_policy:
        container["imagePullPolicy"] = spec.image_pull_policy
    if spec.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": n} for n in spec.image_pull_secrets]


def pod_template(labels: dict[str, str], pod_spec: dict[str, Any]) -> dict[str, Any]:
    template = {"metadata": {"labels": labels}, "spec": pod_spec}
    template["metadata"]["annotations"] = {ANNOTATION_CONFIG_HASH: stable_hash(template)}
    return template


def pod_reader_rbac(owner: Owner, component: Component) -> list[dict[str, Any]]:
    """ServiceAccount/Role/RoleBinding <name>-<component>: may get, list and watch the namespace's pods (the
    Kubernetes discovery of the resource's workers)."""
    name = child_name(owner.name, component)
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": metadata(owner, name, component)},
        {"apiVersion": RBAC_API, "kind": "Role", "metadata": metadata(owner, name, component),
         "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]},
        {"apiVersion": RBAC_API, "kind": "RoleBinding", "metadata": metadata(owner, name, component),
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
         "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": owner.namespace}]},
    ]
