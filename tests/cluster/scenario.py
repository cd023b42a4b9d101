"""What the cluster scenarios share: the CR they apply, client load through the router pod, waits on the CR and
its pods, and the delete that must end every pod process."""
from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from cluster import Cluster
from waiting import wait_for

from disagg.operator import manifests as m
from disagg.operator import naming

PROMPT = "The quick brown fox jumps over the lazy dog"
MODEL = "tiny-llama"


def cr_manifest(name: str, checkpoint: str, **spec: Any) -> dict[str, Any]:
    """A DisaggregatedInference on the tiny checkpoint; `spec` entries replace the defaults' top-level keys."""
    base: dict[str, Any] = {
        "image": "disagg:cluster-test",
        "model": {"servedName": MODEL, "dtype": "float32", "maxModelLen": 512, "source": {"path": checkpoint}},
        "kvTransfer": {"connector": "NixlConnector", "leaseSeconds": 5},
        "prefill": {"replicas": 1, "terminationGracePeriodSeconds": 20},
        "decode": {"replicas": 1, "terminationGracePeriodSeconds": 20},
    }
    return {"apiVersion": "disagg.dev/v1alpha1", "kind": "DisaggregatedInference", "metadata": {"name": name},
            "spec": {**base, **spec}}


def component(name: str, role: str) -> dict[str, str]:
    return {naming.LABEL_INSTANCE: name, naming.LABEL_COMPONENT: role}


def condition(cr: dict[str, Any] | None, ctype: str) -> str | None:
    for c in ((cr or {}).get("status") or {}).get("conditions") or []:
        if c.get("type") == ctype:
            return c.get("status")
    return None


def wait_ready(cluster: Cluster, name: str, timeout: float = 150) -> dict[str, Any]:
    return wait_for(lambda: (cr := cluster.cr(name)) and condition(cr, "Ready") == "True"
                    and condition(cr, "Progressing") == "False" and cr, timeout,
                    f"{name} Ready\n{cluster.logs()}", interval=0.5)


def wait_router_pairs(cluster: Cluster, name: str, timeout: float = 30) -> None:
    """Until the router pod's probes have found a ready prefill and a ready decode: the CR's Ready condition
    comes from the pods' readiness, which the router's own probes (every second) see a moment later - a request
    in between is served by decode alone, correctly, but without a KV transfer."""
    def paired() -> bool:
        try:
            r = httpx.get(f"{router_url(cluster, name)}/ready", timeout=5).json()
        except (httpx.HTTPError, ValueError):
            return False
        return r.get("prefill_ready", 0) >= 1 and r.get("decode_ready", 0) >= 1
    wait_for(paired, timeout, f"{name}'s router to see a ready prefill and decode", interval=0.2)


def pod_url(pod: dict[str, Any]) -> str:
    return f"http://{pod['status']['podIP']}:{naming.HTTP_PORT}"


def router_url(cluster: Cluster, name: str) -> str:
    pods = [p for p in cluster.pods(component(name, "router")) if (p.get("status") or {}).get("podIP")]
    assert len(pods) == 1, pods
    return pod_url(pods[0])


def live_pods(cluster: Cluster, name: str, role: str) -> list[dict[str, Any]]:
    return [p for p in cluster.pods(component(name, role)) if not p["metadata"].get("deletionTimestamp")]


def delete_and_wait(cluster: Cluster, name: str, timeout: float = 90) -> float:
    """kubectl delete the CR; returns the seconds until its last pod process ended and every child was gone."""
    assert cluster.kubelet is not None
    t0 = time.monotonic()
    pods = {p["metadata"]["name"] for p in cluster.pods({naming.LABEL_INSTANCE: name})}
    cluster.kubectl("delete", "disaggregatedinference", name, "--wait=false")

    def left() -> dict[str, Any]:
        """What still exists of the CR, its Deployments, its pods and their processes."""
        return {k: v for k, v in {
            "cr": cluster.cr(name) is not None,
            "deployments": [d["metadata"]["name"] for d in cluster.store.list_objects("apps", "v1", "deployments")
                            if d["metadata"]["name"].startswith(f"{name}-")],
            "pods": [p["metadata"]["name"] for p in cluster.pods({naming.LABEL_INSTANCE: name})],
            "processes": {pod: pids for pod, pids in cluster.kubelet.pids().items() if pod in pods},
        }.items() if v}
    while remaining := left():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"{timeout}s after deleting {name}, still there: {remaining}\n{cluster.logs()}")
        time.sleep(0.2)
    return time.monotonic() - t0


@dataclass
class Outcome:
    status: int  # HTTP status, 0 for a transport error
    finish: str | None  # last finish_reason, or the error
    served_at: float  # monotonic


@dataclass
class Load:
    """`clients` threads streaming one completion after another through the router until stop(); every outcome
    recorded. Bounded: each request times out after `timeout_s`."""
    router: str
    clients: int = 2
    max_tokens: int = 16
    timeout_s: float = 60.0
    outcomes: list[Outcome] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._client, daemon=True) for _ in range(self.clients)]
        for t in self._threads:
            t.start()

    def _client(self) -> None:
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": self.max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=self.timeout_s) as http:
            while not self._stop.is_set():
                finish = None
                try:
                    with http.stream("POST", f"{self.router}/v1/completions", json=body) as r:
                        for line in r.iter_lines():
                            if line.startswith("data: {"):
                                chunk = json.loads(line[len("data: "):])
                                finish = (chunk.get("choices") or [{}])[0].get("finish_reason") or finish
                    self.outcomes.append(Outcome(r.status_code, finish, time.monotonic()))
                except httpx.HTTPError as e:
                    self.outcomes.append(Outcome(0, f"{type(e).__name__}: {e}", time.monotonic()))

    def stop(self) -> list[Outcome]:
        self._stop.set()
        for t in self._threads:
            t.join(90)
        return self.outcomes

    def failures(self) -> list[Outcome]:
        return [o for o in self.outcomes if (o.status, o.finish) != (200, "length")]
