"""One pod's life on the node, in a thread of its own (as the kubelet's pod workers): volumes, init containers in
order to completion, the main containers with probes and restarts (restartPolicy Always), then - once the pod is
deleted - preStop hooks, SIGTERM, the rest of the grace period, SIGKILL, and the final delete (grace 0) that
removes the pod object.
"""
from __future__ import annotations

import logging
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from containers import ContainerProcess, Mount
from pod_env import ContainerConfigError, container_argv, container_env
from pod_status import ContainerState, now_stamp, pod_status
from probes import ContainerProbes

log = logging.getLogger(__name__)
TICK_SECONDS = 0.1
BACKOFF_SECONDS, MAX_BACKOFF_SECONDS = 10.0, 300.0  # CrashLoopBackOff, before time_scale
PRESTOP_OVERRUN_SECONDS = 2.0


class Node(Protocol):
    """What a pod worker needs from its kubelet."""
    name: str
    host_ip: str
    time_scale: float
    entrypoint: list[str]

    def base_env(self, pod: dict[str, Any], pod_ip: str) -> dict[str, str]: ...
    def lookup(self, namespace: str) -> Any: ...
    def mounts(self, pod: dict[str, Any], container: dict[str, Any]) -> list[Mount]: ...
    def log_path(self, pod: dict[str, Any], container: dict[str, Any]) -> Path: ...
    def write_status(self, pod: dict[str, Any], status: dict[str, Any]) -> None: ...
    def remove(self, pod: dict[str, Any]) -> None: ...
    def current(self, pod: dict[str, Any]) -> dict[str, Any] | None: ...


@dataclass
class Run:
    """A container's current process and probes."""
    spec: dict[str, Any]
    state: ContainerState
    process: ContainerProcess | None = None
    probes: ContainerProbes | None = None
    restart_at: float = 0.0  # monotonic: when a crashed container may start again
    starts: int = 0  # processes started; restartCount is one less


class PodWorker:
    def __init__(self, node: Node, pod: dict[str, Any], pod_ip: str):
        self.node, self.pod, self.pod_ip = node, pod, pod_ip
        spec = pod["spec"]
        self.init = [Run(c, ContainerState(c["name"], c.get("image", ""))) for c in spec.get("initContainers") or []]
        self.main = [Run(c, ContainerState(c["name"], c.get("image", ""))) for c in spec["containers"]]
        self.phase = "Pending"
        self.start_time = now_stamp()
        self.deadline: float | None = None  # monotonic end of the grace period, once deletion was seen
        self._last_status: dict[str, Any] | None = None
        self.thread = threading.Thread(target=self._run, name=f"pod-{pod['metadata']['name']}", daemon=True)

    @property
    def name(self) -> str:
        return self.pod["metadata"]["name"]

    def start(self) -> None:
        self.thread.start()

    def terminate(self, grace_seconds: int) -> None:
        """The pod was deleted: stop within `grace_seconds` from now (only a shorter grace period moves it)."""
        deadline = time.monotonic() + grace_seconds
        if self.deadline is None or deadline < self.deadline:
            self.deadline = deadline

    def pids(self) -> list[int]:
        return [r.process.pid for r in self.init + self.main if r.process and r.process.exit_code() is None]

    # ------------------------------------------------------------ the pod's life
    def _run(self) -> None:
        try:
            self._report()
            if self._run_init_containers():
                self.phase = "Running"
                self._run_main_containers()
            self._shut_down()
        except Exception:  # noqa: BLE001 - a kubelet bug must not leave processes behind
            log.exception("pod worker %s failed", self.name)
            for r in self.init + self.main:
                if r.process:
                    r.process.kill_all()
        finally:
            self.node.remove(self.pod)

    def _run_init_containers(self) -> bool:
        """True when every init container succeeded; False when the pod is deleted first or (restartPolicy
        Never) one failed, which fails the pod."""
        for run in self.init:
            while self.deadline is None:
                if run.process is None and time.monotonic() >= run.restart_at:
                    self._start(run)
                code = run.process.exit_code() if run.process else None
                if code == 0:
                    run.state.terminated(0)
                    self._report()
                    break
                if code is not None:
                    self._crashed(run, code)
                    if self.pod["spec"].get("restartPolicy") == "Never":
                        self.phase = "Failed"
                        self._report()
                        return False
                time.sleep(TICK_SECONDS)
            if self.deadline is not None:
                return False
        return True

    def _run_main_containers(self) -> None:
        while self.deadline is None:
            for run in self.main:
                if run.process is None:
                    if time.monotonic() >= run.restart_at:
                        self._start(run)
                    continue
                code = run.process.exit_code()
                if code is not None:
                    self._crashed(run, code)
                elif run.probes is not None and run.probes.tick(self.pod_ip) == "restart":
                    log.info("pod %s container %s failed a probe: restarting", self.name, run.spec["name"])
                    self._stop(run, float(self.pod["spec"].get("terminationGracePeriodSeconds", 30)))
                    self._crashed(run, run.state.state["terminated"]["exitCode"])
                else:
                    run.state.started = run.probes.started if run.probes else True
                    run.state.ready = run.probes.ready if run.probes else True
            self._report()
            time.sleep(TICK_SECONDS)

    def _start(self, run: Run) -> None:
        pod = self.node.current(self.pod) or self.pod
        try:
            env = {**self.node.base_env(pod, self.pod_ip),
                   **container_env({**pod, "status": {"podIP": self.pod_ip, "hostIP": self.node.host_ip}},
                                   run.spec, self.node.lookup(pod["metadata"]["namespace"]))}
            argv = container_argv(run.spec, env, self.node.entrypoint)
            mounts = self.node.mounts(pod, run.spec)
        except ContainerConfigError as e:
            run.state.waiting("CreateContainerConfigError", str(e))
            run.restart_at = time.monotonic() + 1.0
            self._report()
            return
        security = run.spec.get("securityContext") or {}
        run.process = ContainerProcess(argv, env, mounts,
                                       bool(security.get("readOnlyRootFilesystem")),
                                       run.spec.get("workingDir") or "/", self.node.log_path(pod, run.spec))
        run.starts += 1
        run.state.restart_count = run.starts - 1
        run.state.running(run.process.pid)
        run.probes = ContainerProbes(run.spec, self.node.time_scale) if run in self.main else None
        self._report()

    def _crashed(self, run: Run, code: int) -> None:
        assert run.process is not None
        run.process.kill_all()
        run.state.terminated(code)
        backoff = min(BACKOFF_SECONDS * 2 ** (run.starts - 1), MAX_BACKOFF_SECONDS)
        run.restart_at = time.monotonic() + backoff * self.node.time_scale
        run.state.waiting("CrashLoopBackOff", f"exit code {code}")
        run.process, run.probes = None, None
        self._report()

    # ------------------------------------------------------------ termination
    def _stop(self, run: Run, grace_seconds: float) -> None:
        """preStop, SIGTERM, wait out the grace period, SIGKILL (the rules of a pod's deletion, for one run)."""
        assert run.process is not None
        deadline = time.monotonic() + grace_seconds
        hook = ((run.spec.get("lifecycle") or {}).get("preStop") or {}).get("exec")
        if hook:
            proc = run.process.exec_hook(hook["command"], self.node.log_path(self.pod, run.spec))
            while proc.poll() is None and time.monotonic() < deadline and run.process.exit_code() is None:
                time.sleep(TICK_SECONDS)
            if proc.poll() is None:
                proc.kill()
                proc.wait()
                with self.node.log_path(self.pod, run.spec).open("ab") as log:  # say so, as kubectl describe would
                    log.write(f"--- exec hook killed: the grace period ended ({grace_seconds:.1f} s left when the "
                              f"deletion was seen)\n".encode())
            # as the kubelet: a preStop hook that used up the grace period leaves SIGTERM a last 2 seconds
            deadline = max(deadline, time.monotonic() + PRESTOP_OVERRUN_SECONDS)
        run.process.signal(signal.SIGTERM)
        while run.process.exit_code() is None and time.monotonic() < deadline:
            if run.probes is not None and run.probes.tick(self.pod_ip) is None:
                run.state.ready = run.probes.ready
            time.sleep(TICK_SECONDS)
        code = run.process.exit_code()
        run.process.kill_all()
        run.state.terminated(code if code is not None else 137, None if code is not None else "Error")

    def _shut_down(self) -> None:
        if self.deadline is None:  # init failed with restartPolicy Never: wait for the pod's deletion
            while self.deadline is None:
                time.sleep(TICK_SECONDS)
        runs = [r for r in self.init + self.main if r.process is not None]
        threads = [threading.Thread(target=self._stop, args=(r, max(0.0, self.deadline - time.monotonic())))
                   for r in runs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self.phase = "Succeeded" if all(r.state.state["terminated"]["exitCode"] == 0 for r in runs) else "Failed"
        self._report()

    def _report(self) -> None:
        status = pod_status(self.pod_ip, self.node.host_ip, self.start_time, self.phase,
                            [r.state for r in self.init], [r.state for r in self.main])
        if status != self._last_status:
            self.node.write_status(self.pod, status)
            self._last_status = status
