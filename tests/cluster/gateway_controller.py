"""A stand-in gateway controller for the cluster in one box (test code), doing for each InferencePool what a
Gateway API Inference Extension implementation does: a real Envoy (disagg.worker.gateway.envoy_config, the
bootstrap a GIE gateway uses) whose ext_proc goes to the pool's endpoint picker (the pod behind the Service its
endpointPickerRef names) with the pool's failureMode, whose fail-open "pool" cluster is an EDS file of the ready
pods the pool selects at its target port (rewritten as they change), and the pool's status.parents (Accepted,
ResolvedRefs) written as a gateway controller writes them. The parent Gateway is the one the HTTPRoute naming the
pool attaches to.

A real gateway reaches the picker at its Service's ClusterIP; here there are no ClusterIPs, so Envoy is pointed
at the picker pod's IP and restarted (same listener port) when that pod is replaced or the failure mode changes;
with no picker pod left it keeps the last address, whose connections then fail - as a Service without endpoints.
"""
from __future__ import annotations

import datetime
import json
import logging
import os
import signal
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from disagg.worker.gateway.envoy import envoy_argv, find_envoy
from disagg.worker.gateway.envoy_config import GatewayConfig, build_envoy_config, write_pool_endpoints
from disagg.worker.local.process import free_port

log = logging.getLogger(__name__)
POOLS = ("inference.networking.k8s.io", "v1", "inferencepools")
ROUTES = ("gateway.networking.k8s.io", "v1", "httproutes")
DEFAULT_GATEWAY = "stand-in-gateway"


def _matches(labels: dict[str, str] | None, selector: dict[str, str]) -> bool:
    return all((labels or {}).get(k) == v for k, v in selector.items())


def _ready(pod: dict[str, Any]) -> bool:
    st = pod.get("status") or {}
    return bool(st.get("podIP")) and not pod["metadata"].get("deletionTimestamp") and any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in st.get("conditions") or [])


@dataclass
class EnvoyRun:
    """One pool's Envoy: its config, its process, where it listens."""
    config: GatewayConfig
    process: subprocess.Popen
    endpoints: list[tuple[str, int]]

    @property
    def url(self) -> str:
        return f"http://{self.config.listen_host}:{self.config.listen_port}"


class StandInGateway:
    def __init__(self, api_url: str, store: Any, log_dir: Path, namespace: str = "default"):
        self.http = httpx.Client(base_url=api_url, timeout=10)
        self.store, self.log_dir, self.namespace = store, log_dir, namespace
        self.envoys: dict[str, EnvoyRun] = {}  # pool name -> its Envoy
        self.binary = find_envoy()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="stand-in-gateway", daemon=True)

    def start(self) -> StandInGateway:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
        with self._lock:
            for run in self.envoys.values():
                self._end(run)
            self.envoys.clear()
        self.http.close()

    def url(self, pool: str) -> str | None:
        """The gateway's URL for `pool` once its Envoy is ready."""
        with self._lock:
            run = self.envoys.get(pool)
        if run is None:
            return None
        try:
            ok = httpx.get(f"http://{run.config.listen_host}:{run.config.admin_port}/ready", timeout=2).status_code
        except httpx.HTTPError:
            return None
        return run.url if ok == 200 else None

    def failure_mode(self, pool: str) -> str | None:
        with self._lock:
            run = self.envoys.get(pool)
        return run.config.failure_mode if run else None

    # ------------------------------------------------------------ the control loop
    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._sync()
            except Exception:  # noqa: BLE001 - keep reconciling; the next pass retries
                log.exception("stand-in gateway pass failed")
            self._stop.wait(0.2)

    def _sync(self) -> None:
        pools = {p["metadata"]["name"]: p for p in self.store.list_objects(*POOLS, self.namespace)}
        pods = self.store.list_objects("", "v1", "pods", self.namespace)
        for name, pool in pools.items():
            self._sync_pool(pool, pods)
        with self._lock:
            for name in [n for n in self.envoys if n not in pools]:
                self._end(self.envoys.pop(name))

    def _sync_pool(self, pool: dict[str, Any], pods: list[dict[str, Any]]) -> None:
        name, spec = pool["metadata"]["name"], pool["spec"]
        ref = spec["endpointPickerRef"]
        service = self.store.get_object("", "v1", "services", self.namespace, ref["name"])
        self._write_status(pool, resolved=service is not None)
        if service is None:
            return
        picker = self._picker(service, ref["port"]["number"], pods)
        port = spec["targetPorts"][0]["number"]
        endpoints = sorted((p["status"]["podIP"], port) for p in pods
                           if _matches(p["metadata"].get("labels"), spec["selector"]["matchLabels"]) and _ready(p))
        with self._lock:
            run = self.envoys.get(name)
            failure = ref.get("failureMode", "FailClose")
            if picker is None and run is None:
                return  # no picker seen yet: nothing to point Envoy at
            address = picker or (run.config.picker_host, run.config.picker_port)  # type: ignore[union-attr]
            if run is None or (run.config.picker_host, run.config.picker_port, run.config.failure_mode) != \
                    (*address, failure):
                self.envoys[name] = self._start(name, address, failure, endpoints, run)
            elif run.endpoints != endpoints:
                write_pool_endpoints(run.config.pool_eds_path, endpoints)
                run.endpoints = endpoints

    def _picker(self, service: dict[str, Any], port: int, pods: list[dict[str, Any]]) -> tuple[str, int] | None:
        """(pod IP, container port) of a ready pod behind the picker's Service port, as kube-proxy would pick."""
        target = next(p.get("targetPort", port) for p in service["spec"]["ports"] if p["port"] == port)
        for pod in sorted(pods, key=lambda p: p["metadata"]["name"]):
            if not _matches(pod["metadata"].get("labels"), service["spec"]["selector"]) or not _ready(pod):
                continue
            if isinstance(target, int):
                return pod["status"]["podIP"], target
            for c in pod["spec"]["containers"]:
                for p in c.get("ports") or []:
                    if p.get("name") == target:
                        return pod["status"]["podIP"], p["containerPort"]
        return None

    def _start(self, name: str, picker: tuple[str, int], failure: str, endpoints: list[tuple[str, int]],
               old: EnvoyRun | None) -> EnvoyRun:
        """A fresh Envoy (the old one's ports when it is replaced: clients keep the gateway's address)."""
        if old is not None:
            self._end(old)
        eds = self.log_dir / f"envoy-{name}-pool" / "eds.json"
        eds.parent.mkdir(parents=True, exist_ok=True)
        write_pool_endpoints(eds, endpoints)
        listen, admin = (old.config.listen_port, old.config.admin_port) if old else (free_port(), free_port())
        config = GatewayConfig("127.0.0.1", listen, picker[0], picker[1], str(eds), admin, failure)  # type: ignore
        path = self.log_dir / f"envoy-{name}.json"
        path.write_text(json.dumps(build_envoy_config(config)))
        with (self.log_dir / f"envoy-{name}.log").open("ab") as out:
            proc = subprocess.Popen(envoy_argv(self.binary, str(path), concurrency=1), stdout=out,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        log.info("stand-in gateway: Envoy for pool %s on %s, picker %s:%d (%s)", name, listen, *picker, failure)
        return EnvoyRun(config, proc, endpoints)

    @staticmethod
    def _end(run: EnvoyRun) -> None:
        if run.process.poll() is None:
            os.killpg(run.process.pid, signal.SIGTERM)
            try:
                run.process.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(run.process.pid, signal.SIGKILL)
                run.process.wait(10)

    # ------------------------------------------------------------ status, as a gateway controller writes it
    def _parent(self, pool: str) -> dict[str, str]:
        for route in self.store.list_objects(*ROUTES, self.namespace):
            for rule in route["spec"].get("rules") or []:
                refs = rule.get("backendRefs") or []
                if any(b.get("kind") == "InferencePool" and b.get("name") == pool for b in refs):
                    parent = route["spec"]["parentRefs"][0]
                    return {"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": parent["name"],
                            **({"namespace": parent["namespace"]} if parent.get("namespace") else {})}
        return {"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": DEFAULT_GATEWAY}

    def _write_status(self, pool: dict[str, Any], resolved: bool) -> None:
        meta = pool["metadata"]
        current = (pool.get("status") or {}).get("parents") or []
        stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")

        def cond(ctype: str, ok: bool, reason: str, message: str) -> dict[str, Any]:
            old = next((c for p in current for c in p.get("conditions") or [] if c["type"] == ctype), None)
            keep = old is not None and old["status"] == ("True" if ok else "False")
            return {"type": ctype, "status": "True" if ok else "False", "reason": reason, "message": message,
                    "observedGeneration": meta.get("generation", 1),
                    "lastTransitionTime": old["lastTransitionTime"] if keep else stamp}
        parents = [{"parentRef": self._parent(meta["name"]), "conditions": [
            cond("Accepted", True, "Accepted", "the stand-in gateway serves this pool"),
            cond("ResolvedRefs", resolved, "ResolvedRefs" if resolved else "InvalidExtensionRef",
                 "" if resolved else f"Service {pool['spec']['endpointPickerRef']['name']} not found")]}]
        if parents == current:
            return
        r = self.http.patch(f"/apis/{POOLS[0]}/{POOLS[1]}/namespaces/{meta['namespace']}/{POOLS[2]}/{meta['name']}"
                            "/status", json={"status": {"parents": parents}},
                            headers={"Content-Type": "application/merge-patch+json"})
        if r.status_code >= 400 and r.status_code != 404:
            log.warning("status of InferencePool %s: HTTP %s %s", meta["name"], r.status_code, r.text[:200])

