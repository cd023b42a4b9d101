"""Pod status documents as a kubelet reports them (pure functions): phase, conditions, container statuses."""
from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import Any


def now_stamp() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class ContainerState:
    """What the kubelet knows about one container (init or main)."""
    name: str
    image: str
    restart_count: int = 0
    state: dict[str, Any] = field(default_factory=lambda: {"waiting": {"reason": "ContainerCreating"}})
    last_state: dict[str, Any] = field(default_factory=dict)
    ready: bool = False
    started: bool = False
    pid: int | None = None

    def running(self, pid: int) -> None:
        self.pid, self.ready, self.started = pid, False, False
        self.state = {"running": {"startedAt": now_stamp()}}

    def terminated(self, exit_code: int, reason: str | None = None) -> None:
        started = (self.state.get("running") or {}).get("startedAt")
        self.state = {"terminated": {"exitCode": exit_code, "reason": reason or ("Completed" if exit_code == 0
                                                                                 else "Error"),
                                     "startedAt": started, "finishedAt": now_stamp()}}
        self.ready = self.started = False

    def waiting(self, reason: str, message: str = "") -> None:
        if "terminated" in self.state:
            self.last_state = self.state
        self.state = {"waiting": {"reason": reason, **({"message": message} if message else {})}}
        self.ready = self.started = False

    def document(self) -> dict[str, Any]:
        return {"name": self.name, "image": self.image, "imageID": "", "ready": self.ready,
                "started": self.started, "restartCount": self.restart_count, "state": self.state,
                "lastState": self.last_state,
                **({"containerID": f"process://{self.pid}"} if self.pid else {})}


def _condition(ctype: str, ok: bool, reason: str | None = None) -> dict[str, Any]:
    return {"type": ctype, "status": "True" if ok else "False", **({"reason": reason} if reason else {})}


def pod_status(pod_ip: str, host_ip: str, start_time: str, phase: str, init: list[ContainerState],
               main: list[ContainerState]) -> dict[str, Any]:
    initialized = all("terminated" in c.state and c.state["terminated"]["exitCode"] == 0 for c in init) \
        and phase in ("Running", "Succeeded", "Failed")
    ready = phase == "Running" and bool(main) and all(c.ready for c in main)
    return {
        "phase": phase, "podIP": pod_ip, "podIPs": [{"ip": pod_ip}], "hostIP": host_ip, "startTime": start_time,
        "conditions": [_condition("PodScheduled", True), _condition("Initialized", initialized),
                       _condition("ContainersReady", ready, None if ready else "ContainersNotReady"),
                       _condition("Ready", ready, None if ready else "ContainersNotReady")],
        "initContainerStatuses": [c.document() for c in init],
        "containerStatuses": [c.document() for c in main],
    }
