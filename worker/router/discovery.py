"""Where the router's endpoints come from: a static list, or Kubernetes pods matched by label selectors."""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from disagg.worker.router.endpoints import EndpointPool

logger = logging.getLogger(__name__)


REVISION_LABEL = "disagg.dev/revision"  # set by the operator on worker pods


def pod_urls(pods: list, port: int) -> list[str]:
    """Base URLs of running pods that have an IP and are not terminating (readiness is probed separately)."""
    return sorted(pod_revisions(pods, port))


def pod_revisions(pods: list, port: int) -> dict[str, str | None]:
    """url -> serving revision label of each running, non-terminating pod with an IP."""
    out: dict[str, str | None] = {}
    for pod in pods:
        status, meta = pod.status, pod.metadata
        if meta.deletion_timestamp is not None or status is None or status.phase != "Running" or not status.pod_ip:
            continue
        out[f"http://{status.pod_ip}:{port}"] = (getattr(meta, "labels", None) or {}).get(REVISION_LABEL)
    return out


@dataclass
class KubernetesDiscovery:
    namespace: str
    prefill_selector: str
    decode_selector: str
    worker_port: int = 8000
    interval_s: float = 5.0

    def __post_init__(self) -> None:
        try:
            from kubernetes import client, config
        except ModuleNotFoundError:
            raise SystemExit("--discovery kubernetes needs the kubernetes client: pip install 'disagg[operator]'")
        try:
            config.load_incluster_config()
        except config.ConfigException:
            config.load_kube_config()
        self._api = client.CoreV1Api()

    def _list(self, selector: str) -> dict[str, str | None]:
        pods = self._api.list_namespaced_pod(self.namespace, label_selector=selector).items
        return pod_revisions(pods, self.worker_port)

    async def run(self, prefill: EndpointPool, decode: EndpointPool) -> None:
        while True:
            try:
                p_urls = await asyncio.to_thread(self._list, self.prefill_selector)
                d_urls = await asyncio.to_thread(self._list, self.decode_selector)
            except Exception as e:  # noqa: BLE001 - the API server may blip; keep the last membership
                logger.warning("listing pods in %s failed: %s", self.namespace, e)
            else:
                if set(p_urls) != set(prefill.endpoints) or set(d_urls) != set(decode.endpoints):
                    logger.info("discovered %d prefill, %d decode endpoints", len(p_urls), len(d_urls))
                prefill.set_urls(list(p_urls), p_urls)
                decode.set_urls(list(d_urls), d_urls)
            await asyncio.sleep(self.interval_s)
