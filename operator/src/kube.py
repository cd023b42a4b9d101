"""A small synchronous Kubernetes REST client for the children the operator owns.

Credentials come from the `kubernetes` package's loaders (in-cluster service account, else $KUBECONFIG or
~/.kube/config, read at call time); the same settings log kopf in, so both talk to one API server as one user.
In a pod the service-account token file is re-read once the token in use is older than a minute: the kubelet
rotates projected tokens (and they expire).
Objects are plain dicts; writes are JSON merge patches (lists replace, null deletes a key).
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any

from urllib.parse import quote

import httpx

log = logging.getLogger(__name__)

# kind -> plural, for the kinds the operator reads or writes
PLURALS = {
    "Deployment": "deployments",
    "Service": "services",
    "ServiceAccount": "serviceaccounts",
    "Role": "roles",
    "RoleBinding": "rolebindings",
    "DisaggregatedInference": "disaggregatedinferences",
    "Pod": "pods",  # the autoscaler lists worker pods and marks the one to remove (pod-deletion-cost)
    "Secret": "secrets",  # the signed hand-off's key (created once)
    "NetworkPolicy": "networkpolicies",
    "InferencePool": "inferencepools",  # inference.networking.k8s.io (spec.gateway)
    "HTTPRoute": "httproutes",  # gateway.networking.k8s.io (spec.gateway.httpRoute)
}
TRANSIENT_STATUSES = {409, 429, 500, 502, 503, 504}  # 409: a concurrent writer; the next pass re-reads
TOKEN_REFRESH_SECONDS = 60.0  # as the kubernetes package's in-cluster loader


class ApiError(Exception):
    def __init__(self, status: int, method: str, path: str, message: str):
        super().__init__(f"{method} {path}: HTTP {status}: {message}")
        self.status = status


class TransientApiError(ApiError):
    """Worth retrying with backoff: server busy, conflict, connection trouble."""


@dataclass(frozen=True)
class Connection:
    server: str  # e.g. https://10.0.0.1:443
    token: str | None = None
    ca_path: str | None = None
    cert_path: str | None = None
    key_path: str | None = None
    insecure: bool = False
    namespace: str | None = None  # kubeconfig context's namespace or the pod's
    token_path: str | None = None  # in a pod: the service-account token file `token` was read from (rotated)


def load_connection() -> Connection:
    """In a pod: the service account. Elsewhere: $KUBECONFIG (first path) or ~/.kube/config."""
    from kubernetes import client, config  # the operator extra; imported late so `disagg crd` needs none of it
    from kubernetes.config.incluster_config import SERVICE_TOKEN_FILENAME

    cfg = client.Configuration()
    namespace = token_path = None
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        config.load_incluster_config(client_configuration=cfg)  # reads SERVICE_TOKEN_FILENAME (must exist)
        token_path = SERVICE_TOKEN_FILENAME
        ns_file = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
        namespace = open(ns_file).read().strip() if os.path.exists(ns_file) else None
    else:
        path = (os.environ.get("KUBECONFIG") or os.path.expanduser("~/.kube/config")).split(os.pathsep)[0]
        config.load_kube_config(config_file=path, client_configuration=cfg)
        _, active = config.list_kube_config_contexts(config_file=path)
        namespace = (active or {}).get("context", {}).get("namespace")
    auth = cfg.get_api_key_with_prefix("authorization") or cfg.get_api_key_with_prefix("BearerToken")
    token = auth.split(" ", 1)[1] if auth and auth.lower().startswith("bearer ") else None
    return Connection(server=cfg.host, token=token, ca_path=cfg.ssl_ca_cert, cert_path=cfg.cert_file,
                      key_path=cfg.key_file, insecure=not cfg.verify_ssl, namespace=namespace,
                      token_path=token_path if token else None)


def object_path(api_version: str, kind: str, namespace: str, name: str | None = None) -> str:
    base = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    path = f"{base}/namespaces/{namespace}/{PLURALS[kind]}"
    return f"{path}/{name}" if name else path


class _RotatedTokenAuth(httpx.Auth):
    """Bearer auth from a token file the kubelet rotates: re-read once the token in use is `max_age_seconds`
    old. A failed read keeps the token in use (logged); the next request tries again."""

    def __init__(self, path: str, token: str, clock: Callable[[], float], max_age_seconds: float):
        self._path, self._token, self._clock, self._max_age = path, token, clock, max_age_seconds
        self._read_at = clock()
        self._lock = threading.Lock()  # one client serves the reconcile and autoscale threads

    def token(self) -> str:
        with self._lock:
            now = self._clock()
            if now - self._read_at >= self._max_age:
                try:
                    with open(self._path, encoding="utf-8") as f:
                        token = f.read().strip()
                except OSError as e:
                    log.warning("cannot re-read the service-account token %s: %s", self._path, e)
                else:
                    if token:
                        self._token, self._read_at = token, now
                    else:
                        log.warning("service-account token file %s is empty", self._path)
            return self._token

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        request.headers["Authorization"] = f"Bearer {self.token()}"
        yield request


class KubeClient:
    def __init__(self, connection: Connection, timeout_seconds: float = 10.0,
                 clock: Callable[[], float] = time.monotonic,
                 token_refresh_seconds: float = TOKEN_REFRESH_SECONDS):
        """`clock` (seconds) and `token_refresh_seconds` only matter with a token file (connection.token_path)."""
        verify: Any = False if connection.insecure else (connection.ca_path or True)
        cert = (connection.cert_path, connection.key_path) if connection.cert_path else None
        headers: dict[str, str] = {}
        auth: httpx.Auth | None = None
        if connection.token and connection.token_path:
            auth = _RotatedTokenAuth(connection.token_path, connection.token, clock, token_refresh_seconds)
        elif connection.token:
            headers["Authorization"] = f"Bearer {connection.token}"
        self._http = httpx.Client(base_url=connection.server, verify=verify, cert=cert, headers=headers,
                                  auth=auth, timeout=timeout_seconds)

    def close(self) -> None:
        self._http.close()

    def _call(self, method: str, path: str, body: Any = None, content_type: str = "application/json") -> Any:
        try:
            resp = self._http.request(method, path, json=body if body is not None else None,
                                      headers={"Content-Type": content_type} if body is not None else None)
        except httpx.TransportError as e:
            raise TransientApiError(0, method, path, repr(e)) from e
        if resp.status_code >= 400:
            try:
                message = resp.json().get("message", resp.text)
            except ValueError:
                message = resp.text
            cls = TransientApiError if resp.status_code in TRANSIENT_STATUSES else ApiError
            raise cls(resp.status_code, method, path, str(message)[:500])
        return resp.json() if resp.content else None

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return self._call("GET", object_path(api_version, kind, namespace, name))
        except ApiError as e:
            if e.status == 404:
                return None
            raise

    def list_objects(self, api_version: str, kind: str, namespace: str,
                     label_selector: str = "") -> list[dict[str, Any]]:
        params = f"?labelSelector={quote(label_selector)}" if label_selector else ""
        return list(self._call("GET", object_path(api_version, kind, namespace) + params).get("items") or [])

    def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        meta = obj["metadata"]
        return self._call("POST", object_path(obj["apiVersion"], obj["kind"], meta["namespace"]), obj)

    def patch(self, api_version: str, kind: str, namespace: str, name: str, patch: dict[str, Any],
              subresource: str | None = None) -> dict[str, Any]:
        path = object_path(api_version, kind, namespace, name) + (f"/{subresource}" if subresource else "")
        return self._call("PATCH", path, patch, "application/merge-patch+json")

    def delete(self, api_version: str, kind: str, namespace: str, name: str) -> None:
        """Gone already is fine; the object's dependents (a Deployment's ReplicaSets) are collected after it."""
        try:
            self._call("DELETE", object_path(api_version, kind, namespace, name),
                       {"apiVersion": "v1", "kind": "DeleteOptions", "propagationPolicy": "Background"})
        except ApiError as e:
            if e.status != 404:
                raise
