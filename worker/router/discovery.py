"""Where the router's endpoints come from: a static list, a JSON file another process rewrites (`disagg up`
while it scales local workers), or Kubernetes pods matched by label selectors."""
from __future__ import annotations

import asyncio
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from disagg.operator.naming import LABEL_REVISION as REVISION_LABEL  # set by the operator on worker pods
from disagg.worker.router.endpoints import EndpointPool

logger = logging.getLogger(__name__)


def pod_urls(pods: list, port: int) -> list[str]:
    """Base URLs of running pods that have an IP and are not terminating (readiness is probed separately)."""
    return sorted(pod_revisions(pods, port))


def pod_revisions(pods: list, port: int) -> dict[str, str | None]:
    """url -> serving revision label of each running, non-terminating pod with an IP."""
    return {url: revision for url, (revision, _) in pod_members(pods, port).items()}


def pod_members(pods: list, port: int) -> dict[str, tuple[str | None, str]]:
    """url -> (serving revision label, pod name) of each running, non-terminating pod with an IP."""
    out: dict[str, tuple[str | None, str]] = {}
    for pod in pods:
        status, meta = pod.status, pod.metadata
        if meta.deletion_timestamp is not None or status is None or status.phase != "Running" or not status.pod_ip:
            continue
        out[f"http://{status.pod_ip}:{port}"] = ((getattr(meta, "labels", None) or {}).get(REVISION_LABEL),
                                                 getattr(meta, "name", None) or status.pod_ip)
    return out


LIST_TIMEOUT_S = (5.0, 10.0)  # (connect, read) of one pod listing: a hung API server must not hang discovery


@dataclass
class KubernetesDiscovery:
    namespace: str
    prefill_selector: str
    decode_selector: str | None
    worker_port: int = 8000
    interval_s: float = 5.0
    roles: tuple[str, ...] = ("prefill", "decode")  # the pools it keeps (a decode side's hop: prefill only)

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

    def _list(self, selector: str) -> dict[str, tuple[str | None, str]]:
        pods = self._api.list_namespaced_pod(self.namespace, label_selector=selector,
                                             _request_timeout=LIST_TIMEOUT_S).items
        return pod_members(pods, self.worker_port)

    async def run(self, prefill: EndpointPool, decode: EndpointPool) -> None:
        while True:
            pools = {"prefill": (prefill, self.prefill_selector), "decode": (decode, self.decode_selector)}
            try:
                found = {role: await asyncio.to_thread(self._list, pools[role][1]) for role in self.roles}
            except Exception as e:  # noqa: BLE001 - the API server may blip; keep the last membership
                logger.warning("listing pods in %s failed: %s", self.namespace, e)
            else:
                if any(set(urls) != set(pools[role][0].endpoints) for role, urls in found.items()):
                    logger.info("discovered %s", ", ".join(f"{len(u)} {r}" for r, u in found.items()))
                for role, members in found.items():
                    pools[role][0].set_urls(list(members), {u: r for u, (r, _) in members.items()},
                                            {u: n for u, (_, n) in members.items()})
            await asyncio.sleep(self.interval_s)


# ---------------------------------------------------------------- a file: {"prefill": [urls], "decode": [urls]}
def parse_endpoints(text: str, source: str = "endpoints file") -> dict[str, list[str]]:
    """The file's roles -> URLs. Raises ValueError naming what is wrong."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{source}: not JSON ({e})") from None
    if not isinstance(doc, dict):
        raise ValueError(f"{source}: expected an object {{\"prefill\": [urls], \"decode\": [urls]}}, got {doc!r:.80}")
    out = {}
    for role in ("prefill", "decode"):
        urls = doc.get(role, [])
        if not isinstance(urls, list) or not all(isinstance(u, str) and u for u in urls):
            raise ValueError(f"{source}: {role!r} must be a list of URL strings, got {urls!r:.80}")
        out[role] = urls
    return out


def parse_kv_events(text: str) -> dict[str, dict]:
    """The file's optional "kv_events": {url: {"endpoint", "replay_endpoint", "topic"}} - where each worker
    publishes KV-cache events when it does not say so itself (vLLM has no GET /kv_events). Entries without a
    string endpoint are left out."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError:
        return {}
    events = doc.get("kv_events") if isinstance(doc, dict) else None
    if not isinstance(events, dict):
        return {}
    return {url: info for url, info in events.items()
            if isinstance(info, dict) and isinstance(info.get("endpoint"), str)}


def parse_names(text: str) -> dict[str, str]:
    """The file's optional "names": {url: name} (string values only)."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError:
        return {}
    names = doc.get("names") if isinstance(doc, dict) else None
    return {u: n for u, n in names.items() if isinstance(n, str)} if isinstance(names, dict) else {}


def write_endpoints(path: str | Path, prefill: list[str], decode: list[str],
                    kv_events: dict[str, dict] | None = None, names: dict[str, str] | None = None) -> None:
    """Replace the file atomically (a reader never sees half of it). names: url -> a name for per-endpoint
    metrics (`disagg up`'s process names)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    doc: dict = {"prefill": prefill, "decode": decode}
    if kv_events:
        doc["kv_events"] = kv_events
    if names:
        doc["names"] = names
    tmp.write_text(json.dumps(doc, indent=1))
    os.replace(tmp, path)


@dataclass
class FileDiscovery:
    """Re-reads `path` whenever it changes (checked every `interval_s`); an unreadable or invalid file keeps
    the last membership."""

    path: str
    interval_s: float = 1.0
    _seen: tuple | None = field(default=None, repr=False)  # (mtime_ns, inode, size) of the last read
    kv_events: dict[str, dict] = field(default_factory=dict)  # url -> where it publishes KV-cache events
    roles: tuple[str, ...] = ("prefill", "decode")  # the pools it keeps (a decode side's hop: prefill only)
    _error: str | None = field(default=None, repr=False)  # the last problem logged (each is logged once)

    def poll(self, prefill: EndpointPool, decode: EndpointPool) -> bool:
        """Apply the file if it changed since the last poll; True when it did."""
        try:
            st = os.stat(self.path)
            key = (st.st_mtime_ns, st.st_ino, st.st_size)
            if key == self._seen:
                return False
            text = Path(self.path).read_text()
            urls = parse_endpoints(text, self.path)
        except (OSError, ValueError) as e:
            if str(e) != self._error:  # once, not every interval (a launcher writes the file after its workers start)
                logger.warning("endpoints file: %s; keeping %d prefill, %d decode endpoints", e,
                               len(prefill.endpoints), len(decode.endpoints))
                self._error = str(e)
            return False
        self._seen, self._error = key, None
        self.kv_events = parse_kv_events(text)
        names = parse_names(text)
        pools = {"prefill": prefill, "decode": decode}
        if any(set(urls[role]) != set(pools[role].endpoints) for role in self.roles):
            logger.info("endpoints file: %s", ", ".join(f"{role}={urls[role]}" for role in self.roles))
        for role in self.roles:
            pools[role].set_urls(urls[role], names=names)
        return True

    async def run(self, prefill: EndpointPool, decode: EndpointPool) -> None:
        while True:
            self.poll(prefill, decode)
            await asyncio.sleep(self.interval_s)
