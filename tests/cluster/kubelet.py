"""The node agent of the cluster in one box: binds every new pod to this node, gives it a loopback IP of its own
(127.A.B.N; Linux routes all of 127/8 to lo), runs it in a PodWorker and, when the pod is deleted, has the worker
stop it within the pod's grace period. Pods are read from the API server's store; every write (binding, status,
the final delete) goes over HTTP, so watchers (kopf, the router, kubectl) see them.

Each pod's volumes: emptyDir -> a fresh directory under the node's root; persistentVolumeClaim -> the host
directory a test registered for the claim name (the pod waits, Pending, until there is one).
The "image": the container's command runs on this host with the image's environment (PATH with `disagg` first:
a wrapper running this venv's `python -m disagg.worker.cli`), plus KUBECONFIG - the stand-in for the
service-account mount, so in-pod API clients (the router's discovery) reach the emulator - and the pod network
shim (pod_network/sitecustomize.py), whose pod-local 127.0.0.1 needs a directory the pod's containers share
(mounted in each of them at the node's `pod-loopback` path: one per node, so clusters on one machine never share it).
"""
from __future__ import annotations

import base64
import logging
import random
import shutil
import os
import socket
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from containers import Mount, ensure_mount_points
from pod_env import ContainerConfigError
from pod_worker import PodWorker

log = logging.getLogger(__name__)
POD_NETWORK_SHIM = Path(__file__).resolve().parent / "pod_network"
POD_IP_ENV = "CLUSTER_IN_A_BOX_POD_IP"  # read by the shim
LOOPBACK_ENV = "CLUSTER_IN_A_BOX_LOOPBACK"  # the shim notes the pod's 127.0.0.1 ports there
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class IpPool:
    """127.A.B.2 .. 127.A.B.254 for a random A.B: runs on one machine do not collide."""

    def __init__(self) -> None:
        self.prefix = f"127.{random.randint(10, 250)}.{random.randint(0, 255)}"
        self._free = list(range(2, 255))
        self._lock = threading.Lock()

    def allocate(self) -> str:
        with self._lock:
            while self._free:
                ip = f"{self.prefix}.{self._free.pop(0)}"
                with socket.socket() as s:  # someone else's server on this address: skip it
                    try:
                        s.bind((ip, 8000))
                    except OSError:
                        continue
                return ip
        raise RuntimeError("pod IP pool exhausted")

    def release(self, ip: str) -> None:
        with self._lock:
            self._free.append(int(ip.rsplit(".", 1)[1]))


def write_image_bin(directory: Path) -> Path:
    """The image's `disagg` entrypoint: this interpreter running the package's CLI; and `vllm` (the engine image's
    command) where the vLLM tier's DISAGG_VLLM names one."""
    directory.mkdir(parents=True, exist_ok=True)
    wrapper = directory / "disagg"
    wrapper.write_text(f'#!/bin/sh\nexec {sys.executable} -m disagg.worker.cli "$@"\n')
    wrapper.chmod(0o755)
    vllm = os.environ.get("DISAGG_VLLM")
    if vllm and os.access(vllm, os.X_OK):
        (directory / "vllm").write_text(f'#!/bin/sh\nexec {vllm} "$@"\n')
        (directory / "vllm").chmod(0o755)
    return directory


@dataclass
class NodeSettings:
    root: Path  # pod volumes, the image's bin directory; outside /tmp (pods mount their own /tmp)
    log_dir: Path  # <namespace>_<pod>_<container>.log
    kubeconfig: Path
    time_scale: float = 0.2  # probe periods and restart backoff (see probes.py)
    name: str = "node-1"
    claims: dict[str, Path] = field(default_factory=dict)  # PVC claim name -> host directory


class Kubelet:
    def __init__(self, api_url: str, store: Any, settings: NodeSettings):
        """`store`: the API server (ClusterApiServer) whose thread-safe reads list the pods."""
        self.settings, self.store = settings, store
        self.name, self.time_scale = settings.name, settings.time_scale
        self.host_ip = "127.0.0.1"
        self.entrypoint = ["disagg"]
        self.http = httpx.Client(base_url=api_url, timeout=10)
        self.ips = IpPool()
        self.workers: dict[str, PodWorker] = {}  # pod uid -> its worker
        self._created_mount_points: list[Path] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kubelet", daemon=True)
        self._image_path = write_image_bin(settings.root / "image-bin")
        self.loopback_mount = settings.root / "pod-loopback"  # each container: its pod's own directory here
        self.loopback_mount.mkdir(parents=True, exist_ok=True)
        settings.log_dir.mkdir(parents=True, exist_ok=True)

    def start(self) -> Kubelet:
        self._thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Force-stop what still runs (grace 0), then remove the mount points this kubelet created."""
        self._stop.set()
        self._thread.join(timeout)
        for worker in list(self.workers.values()):
            worker.terminate(0)
        for worker in list(self.workers.values()):
            worker.thread.join(timeout)
        for path in reversed(self._created_mount_points):
            try:
                path.rmdir()
            except OSError:
                pass
        self.http.close()

    def pids(self) -> dict[str, list[int]]:
        """pod name -> PIDs of its running container processes."""
        return {w.name: w.pids() for w in list(self.workers.values()) if w.pids()}

    # ------------------------------------------------------------ the sync loop
    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._sync(self.store.list_objects("", "v1", "pods"))
            except Exception:  # noqa: BLE001 - keep the node alive; the next pass retries
                log.exception("kubelet sync failed")
            self._stop.wait(0.1)

    def _sync(self, pods: list[dict[str, Any]]) -> None:
        present = {p["metadata"]["uid"] for p in pods}
        for pod in pods:
            uid, meta = pod["metadata"]["uid"], pod["metadata"]
            node = (pod.get("spec") or {}).get("nodeName")
            if node not in (None, self.name) or (node is None and meta.get("deletionTimestamp")):
                continue
            worker = self.workers.get(uid)
            if worker is None and not meta.get("deletionTimestamp"):
                worker = self._admit(pod)
            if worker is not None and meta.get("deletionTimestamp"):
                worker.terminate(int(meta.get("deletionGracePeriodSeconds", 0)))
        for uid, worker in list(self.workers.items()):
            if uid not in present:  # removed without us (force delete): stop at once
                worker.terminate(0)

    def _admit(self, pod: dict[str, Any]) -> PodWorker | None:
        meta = pod["metadata"]
        if (pod.get("spec") or {}).get("nodeName") is None:
            r = self.http.patch(f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}",
                                json={"spec": {"nodeName": self.name}},
                                headers={"Content-Type": "application/merge-patch+json"})
            if r.status_code >= 400:
                return None
            pod = r.json()
        worker = PodWorker(self, pod, self.ips.allocate())
        self.workers[pod["metadata"]["uid"]] = worker
        worker.start()
        return worker

    # ------------------------------------------------------------ what pod workers ask (pod_worker.Node)
    def base_env(self, pod: dict[str, Any], pod_ip: str) -> dict[str, str]:
        return {"PATH": f"{self._image_path}:{SYSTEM_PATH}", "HOME": "/", "PYTHONUNBUFFERED": "1",
                "HF_HOME": "/var/cache/huggingface", "HOSTNAME": pod["metadata"]["name"],
                "KUBECONFIG": str(self.settings.kubeconfig), "PYTHONPATH": str(POD_NETWORK_SHIM),
                POD_IP_ENV: pod_ip, LOOPBACK_ENV: str(self.loopback_mount)}

    def lookup(self, namespace: str) -> Any:
        def find(kind: str, name: str) -> dict[str, str] | None:
            plural = {"Secret": "secrets", "ConfigMap": "configmaps"}[kind]
            obj = self.store.get_object("", "v1", plural, namespace, name)
            if obj is None:
                return None
            if kind == "ConfigMap":
                return dict(obj.get("data") or {})
            data = {k: base64.b64decode(v).decode() for k, v in (obj.get("data") or {}).items()}
            return {**data, **(obj.get("stringData") or {})}
        return find

    def mounts(self, pod: dict[str, Any], container: dict[str, Any]) -> list[Mount]:
        volumes = {v["name"]: v for v in pod["spec"].get("volumes") or []}
        out = []
        for vm in container.get("volumeMounts") or []:
            out.append(Mount(self._volume_dir(pod, volumes[vm["name"]]), vm["mountPath"],
                             bool(vm.get("readOnly"))))
        loopback = self.settings.root / "pods" / pod["metadata"]["uid"] / "loopback"
        loopback.mkdir(parents=True, exist_ok=True)
        out.append(Mount(loopback, str(self.loopback_mount)))
        with self._lock:
            self._created_mount_points += ensure_mount_points(out)
        return out

    def _volume_dir(self, pod: dict[str, Any], volume: dict[str, Any]) -> Path:
        if "emptyDir" in volume:
            path = self.settings.root / "pods" / pod["metadata"]["uid"] / "volumes" / volume["name"]
            path.mkdir(parents=True, exist_ok=True)
            return path
        if "persistentVolumeClaim" in volume:
            claim = volume["persistentVolumeClaim"]["claimName"]
            if claim not in self.settings.claims:
                raise ContainerConfigError(f"persistentvolumeclaim {claim!r} is not bound "
                                           "(no host directory registered for it)")
            return self.settings.claims[claim]
        raise ContainerConfigError(f"volume {volume['name']}: only emptyDir and persistentVolumeClaim are supported")

    def log_path(self, pod: dict[str, Any], container: dict[str, Any]) -> Path:
        meta = pod["metadata"]
        return self.settings.log_dir / f"{meta['namespace']}_{meta['name']}_{container['name']}.log"

    def current(self, pod: dict[str, Any]) -> dict[str, Any] | None:
        meta = pod["metadata"]
        return self.store.get_object("", "v1", "pods", meta["namespace"], meta["name"])

    def write_status(self, pod: dict[str, Any], status: dict[str, Any]) -> None:
        meta = pod["metadata"]
        r = self.http.patch(f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}/status",
                            json={"status": status}, headers={"Content-Type": "application/merge-patch+json"})
        if r.status_code >= 400 and r.status_code != 404:
            log.warning("status of pod %s: HTTP %s %s", meta["name"], r.status_code, r.text[:200])

    def remove(self, pod: dict[str, Any]) -> None:
        """The pod's containers are gone: delete the object for good and free its IP and volumes. Only this pod
        (its uid): a new pod of the same name may have been created since this one was deleted."""
        meta = pod["metadata"]
        self.http.request("DELETE", f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}",
                          json={"gracePeriodSeconds": 0, "preconditions": {"uid": meta["uid"]}})
        worker = self.workers.pop(meta["uid"], None)
        if worker is not None:
            self.ips.release(worker.pod_ip)
        shutil.rmtree(self.settings.root / "pods" / meta["uid"], ignore_errors=True)
