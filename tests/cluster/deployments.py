"""A Deployment controller for the cluster in one box (no ReplicaSet layer: pods are owned by the Deployment).

- Pods come from spec.template, labelled pod-template-hash=<hash of the template>, owned by the Deployment.
- Scale down removes pods in the ReplicaSet controller's order: not yet running, then not ready, then lower
  controller.kubernetes.io/pod-deletion-cost, then the newest.
- A changed template rolls: RollingUpdate with maxSurge / maxUnavailable (default 25%, surge rounded up,
  unavailable down): new pods are created up to replicas + maxSurge; old pods are deleted while at least
  replicas - maxUnavailable pods stay ready.
- status: replicas, updatedReplicas, readyReplicas, availableReplicas, unavailableReplicas,
  observedGeneration (terminating pods are not counted, as a ReplicaSet does not count them).
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import threading
import uuid
from typing import Any

import httpx

log = logging.getLogger(__name__)
HASH_LABEL = "pod-template-hash"
DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"


def template_hash(template: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()[:10]


def pod_ready(pod: dict[str, Any]) -> bool:
    st = pod.get("status") or {}
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in st.get("conditions") or [])


def removal_order(pods: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Pods in the order a ReplicaSet removes them (first = removed first)."""
    def rank(pod: dict[str, Any]) -> tuple:
        meta, st = pod["metadata"], pod.get("status") or {}
        cost = int((meta.get("annotations") or {}).get(DELETION_COST, 0))
        return (st.get("phase") == "Running", pod_ready(pod), cost, _negated(meta.get("creationTimestamp", "")),
                _negated(meta["name"]))
    return sorted(pods, key=rank)


def _negated(text: str) -> tuple[int, ...]:
    return tuple(-ord(c) for c in text)  # newest (largest timestamp) first


def resolve(value: int | str | None, replicas: int, round_up: bool) -> int:
    if value is None:
        value = "25%"
    if isinstance(value, str) and value.endswith("%"):
        exact = replicas * int(value[:-1]) / 100
        return math.ceil(exact) if round_up else math.floor(exact)
    return int(value)


def rollout_step(replicas: int, new: list[dict], old: list[dict], strategy: dict[str, Any]) -> tuple[int, list[dict]]:
    """(pods to create with the new template, pods to delete) for one pass."""
    rolling = strategy.get("rollingUpdate") or {}
    surge = resolve(rolling.get("maxSurge"), replicas, True)
    unavailable = resolve(rolling.get("maxUnavailable"), replicas, False)
    if surge == 0 and unavailable == 0:
        unavailable = 1
    if not old:  # plain scaling
        if len(new) < replicas:
            return replicas - len(new), []
        return 0, removal_order(new)[:len(new) - replicas]
    create = max(0, min(replicas - len(new), replicas + surge - len(new) - len(old)))
    ready = sum(pod_ready(p) for p in new + old)
    # unready old pods may go at once; ready ones while enough stay ready
    unready_old = [p for p in old if not pod_ready(p)]
    removable = max(0, ready - (replicas - unavailable))
    ready_old = [p for p in removal_order(old) if pod_ready(p)]
    delete = unready_old + ready_old[:removable]
    surplus_new = max(0, len(new) - replicas)
    return create, delete + removal_order(new)[:surplus_new]


class DeploymentController:
    def __init__(self, api_url: str, store: Any):
        self.store = store
        self.http = httpx.Client(base_url=api_url, timeout=10)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="deployment-controller", daemon=True)

    def start(self) -> DeploymentController:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self.http.close()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                pods = self.store.list_objects("", "v1", "pods")
                for dep in self.store.list_objects("apps", "v1", "deployments"):
                    if not dep["metadata"].get("deletionTimestamp"):
                        self.sync(dep, pods)
            except Exception:  # noqa: BLE001 - the next pass retries
                log.exception("deployment sync failed")
            self._stop.wait(0.1)

    def sync(self, dep: dict[str, Any], all_pods: list[dict[str, Any]]) -> None:
        uid, spec = dep["metadata"]["uid"], dep["spec"]
        owned = [p for p in all_pods if any(r.get("uid") == uid for r in p["metadata"].get("ownerReferences") or [])]
        live = [p for p in owned if not p["metadata"].get("deletionTimestamp")]
        digest = template_hash(spec["template"])
        new = [p for p in live if (p["metadata"].get("labels") or {}).get(HASH_LABEL) == digest]
        old = [p for p in live if p not in new]
        replicas = int(spec.get("replicas", 1))
        create, delete = rollout_step(replicas, new, old, spec.get("strategy") or {})
        for _ in range(create):
            self._create_pod(dep, digest)
        for pod in delete:
            self._delete_pod(pod)
        self._write_status(dep, live, new, digest)

    def _create_pod(self, dep: dict[str, Any], digest: str) -> None:
        meta, template = dep["metadata"], dep["spec"]["template"]
        tmeta = template.get("metadata") or {}
        pod = {"apiVersion": "v1", "kind": "Pod",
               "metadata": {"name": f"{meta['name']}-{digest[:8]}-{uuid.uuid4().hex[:5]}",
                            "namespace": meta["namespace"],
                            "labels": {**(tmeta.get("labels") or {}), HASH_LABEL: digest},
                            "annotations": dict(tmeta.get("annotations") or {}),
                            "ownerReferences": [{"apiVersion": "apps/v1", "kind": "Deployment", "name": meta["name"],
                                                 "uid": meta["uid"], "controller": True,
                                                 "blockOwnerDeletion": True}]},
               "spec": {"restartPolicy": "Always", **template["spec"]}}
        r = self.http.post(f"/api/v1/namespaces/{meta['namespace']}/pods", json=pod)
        if r.status_code >= 400:
            log.warning("creating a pod of %s: HTTP %s %s", meta["name"], r.status_code, r.text[:200])

    def _delete_pod(self, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        self.http.request("DELETE", f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}", json={})

    def _write_status(self, dep: dict[str, Any], live: list[dict], new: list[dict], digest: str) -> None:
        ready = sum(pod_ready(p) for p in live)
        replicas = int(dep["spec"].get("replicas", 1))
        status = {"observedGeneration": dep["metadata"].get("generation", 1), "replicas": len(live),
                  "updatedReplicas": len(new), "readyReplicas": ready, "availableReplicas": ready,
                  "unavailableReplicas": max(0, replicas - ready)}
        old = dep.get("status") or {}
        if {k: old.get(k) for k in status} != status:
            meta = dep["metadata"]
            self.http.patch(f"/apis/apps/v1/namespaces/{meta['namespace']}/deployments/{meta['name']}/status",
                            json={"status": status}, headers={"Content-Type": "application/merge-patch+json"})
