"""A Kubernetes cluster in one box: the API server (emulator + graceful deletion + GC), a Deployment controller, a
kubelet running pods as local processes, and the operator (kopf in a thread) - plus `kubectl` against it all.
"""
from __future__ import annotations

import json
import logging
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import yaml

from api_server import ClusterApiServer
from deployments import DeploymentController
from emulator import EmulatorThread, Kind
from helm_cli import kubectl_binary
from kubelet import Kubelet, NodeSettings
from operator_harness import CR, OperatorThread

from disagg.operator import spec as s

# what the scenarios apply besides the CR
EXTRA_KINDS = {("", "v1", "configmaps"): Kind("ConfigMap", short_names=("cm",)),
               ("", "v1", "persistentvolumeclaims"): Kind("PersistentVolumeClaim", status_subresource=True,
                                                          short_names=("pvc",))}
CRD_FILE = Path(__file__).resolve().parents[2] / "crds" / f"{s.PLURAL}.{s.GROUP}.yaml"
NODE_PARENT = "/var/tmp"  # not /tmp: every pod mounts an emptyDir of its own there


class Cluster:
    def __init__(self, log_dir: Path, time_scale: float = 0.2):
        self.node_root = Path(tempfile.mkdtemp(prefix="cluster-in-a-box-", dir=NODE_PARENT))
        self.log_dir = log_dir
        self.time_scale = time_scale
        self.api = EmulatorThread(ClusterApiServer())
        self.kubeconfig = self.node_root / "kubeconfig.yaml"
        self.kubectl_path = str(kubectl_binary())
        self.controller: DeploymentController | None = None
        self.kubelet: Kubelet | None = None
        self.operator: OperatorThread | None = None
        self._saved_env: dict[str, str | None] = {}
        self._operator_log: logging.Handler | None = None

    @property
    def store(self) -> ClusterApiServer:
        return self.api.emulator  # type: ignore[return-value]

    def start(self) -> Cluster:
        self.api.start()
        for key, kind in EXTRA_KINDS.items():
            self.store.declare(*key, kind)
        with self.api.client() as http:
            http.post("/api/v1/namespaces", json={"metadata": {"name": "default"}}).raise_for_status()
        self.kubeconfig.write_text(yaml.safe_dump(self.api.kubeconfig()))
        self.kubectl("apply", "--validate=false", "-f", str(CRD_FILE))  # as a platform team installs it
        assert CR in self.store.kinds, f"{CRD_FILE} did not serve {CR}"
        for var, value in (("KUBECONFIG", str(self.kubeconfig)), ("KUBERNETES_SERVICE_HOST", None)):
            self._saved_env[var] = os.environ.get(var)  # the operator runs in this process and reads these
            if value is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = value
        self.controller = DeploymentController(self.api.url, self.store).start()
        self.kubelet = Kubelet(self.api.url, self.store, NodeSettings(
            root=self.node_root, log_dir=self.log_dir, kubeconfig=self.kubeconfig, time_scale=self.time_scale)).start()
        self._operator_log = logging.FileHandler(self.log_dir / "operator.log")  # printed with the pods' logs
        self._operator_log.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        self._operator_log.addFilter(lambda r: "Timer 'resync' succeeded" not in r.getMessage())  # every 0.3 s
        for name in ("kopf", "disagg.operator"):
            logging.getLogger(name).addHandler(self._operator_log)
            logging.getLogger(name).setLevel(logging.INFO)
        self.operator = OperatorThread().start()
        return self

    def stop(self) -> None:
        if self.operator is not None:
            self.operator.stop()
        if self.controller is not None:
            self.controller.stop()
        if self.kubelet is not None:
            self.kubelet.stop()
        self.api.stop()
        if self._operator_log is not None:
            for name in ("kopf", "disagg.operator"):
                logging.getLogger(name).removeHandler(self._operator_log)
            self._operator_log.close()
        for var, value in self._saved_env.items():
            if value is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = value
        subprocess.run(["rm", "-rf", str(self.node_root)], check=False)

    def register_claim(self, claim_name: str, host_dir: Path) -> None:
        """The host directory that backs PersistentVolumeClaim `claim_name` (every pod mounting it shares it,
        as with ReadWriteMany); pods using an unregistered claim wait in CreateContainerConfigError."""
        assert self.kubelet is not None
        self.kubelet.settings.claims[claim_name] = Path(host_dir)

    # ------------------------------------------------------------ driving it
    def kubectl(self, *args: str, input: str | None = None, check: bool = True) -> str:
        proc = subprocess.run([self.kubectl_path, f"--kubeconfig={self.kubeconfig}", *args], input=input,
                              capture_output=True, text=True, timeout=60)
        if check and proc.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed ({proc.returncode}): {proc.stderr}")
        return proc.stdout

    def apply(self, manifest: dict[str, Any]) -> str:
        return self.kubectl("apply", "--validate=false", "-f", "-", input=yaml.safe_dump(manifest))

    def patch_cr(self, name: str, patch: dict[str, Any]) -> str:
        return self.kubectl("patch", "disaggregatedinference", name, "--type=merge", "-p", json.dumps(patch))

    def pods(self, selector: dict[str, str] | None = None) -> list[dict[str, Any]]:
        pods = self.store.list_objects("", "v1", "pods", "default")
        return [p for p in pods if all((p["metadata"].get("labels") or {}).get(k) == v
                                       for k, v in (selector or {}).items())]

    def cr(self, name: str) -> dict[str, Any] | None:
        return self.store.get_object(*CR, "default", name)

    def logs(self, tail: int = 40) -> str:
        out = []
        for path in sorted(self.log_dir.glob("*.log")):
            lines = path.read_text(errors="replace").splitlines()
            out.append(f"==== {path.name} (last {min(tail, len(lines))} of {len(lines)} lines)\n"
                       + "\n".join(lines[-tail:]))
        return "\n".join(out)
