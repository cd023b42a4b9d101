"""The container runtime of the cluster in one box: a container is a local process in a mount namespace of its
own (`unshare --mount`), with each volume bind-mounted at its mountPath and, when the container asks for
readOnlyRootFilesystem, the root filesystem read-only. The process is the container's PID 1 (unshare and sh
exec into it), in a session of its own so the whole container can be killed at once.

No network namespace: pods share the host's, each on its own 127.0.0.N (see pod_network/sitecustomize.py).
Needs root (mount namespaces); the tier skips without it.
"""
from __future__ import annotations

import atexit
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Mount:
    source: Path  # host directory
    target: str  # the container's mountPath
    read_only: bool = False


def image_paths() -> list[str]:
    """What the pods' "image" is made of on this host: the checkout (editable install), this interpreter's venv
    and vLLM's (DISAGG_VLLM). A volume mounted over one of them (a CI checkout under /tmp, where every pod
    mounts its own emptyDir) must not hide it."""
    paths = {str(Path(__file__).resolve().parents[2]), sys.prefix}
    vllm = os.environ.get("DISAGG_VLLM")
    if vllm:
        paths.add(str(Path(vllm).resolve().parents[1]))
    return sorted(paths)


_HOLD = Path(tempfile.mkdtemp(prefix="cluster-image-hold-", dir="/var/tmp"))  # outside every mountPath
atexit.register(shutil.rmtree, _HOLD, True)


def mount_script(mounts: list[Mount], read_only_root: bool, working_dir: str) -> str:
    """sh script run inside the new mount namespace before exec'ing the container's argv ("$@")."""
    lines = ["set -e"]
    shadowed = [(p, _HOLD / str(i)) for i, p in enumerate(image_paths())
                if any(p == m.target or p.startswith(m.target.rstrip("/") + "/") for m in mounts)]
    for path, hold in shadowed:  # keep a handle on the image paths a volume will cover ...
        hold.mkdir(exist_ok=True)
        lines.append(f"mount --bind {shlex.quote(path)} {shlex.quote(str(hold))}")
    for m in mounts:
        lines.append(f"mount --bind {shlex.quote(str(m.source))} {shlex.quote(m.target)}")
        if m.read_only:
            lines.append(f"mount -o remount,bind,ro {shlex.quote(m.target)}")
    for path, hold in shadowed:  # ... and put them back on top of it, as they are in the image
        lines.append(f"mkdir -p {shlex.quote(path)} && mount --bind {shlex.quote(str(hold))} {shlex.quote(path)}")
    if read_only_root:  # after the volume mounts: they are mounts of their own and stay writable
        lines.append("mount -o remount,bind,ro /")
    lines.append(f"cd {shlex.quote(working_dir)}")
    lines.append('exec "$@"')
    return "\n".join(lines)


def ensure_mount_points(mounts: list[Mount]) -> list[Path]:
    """Mount points must exist on the shared root filesystem; returns the directories this call created (the
    kubelet removes them at shutdown)."""
    created = []
    for m in mounts:
        target = Path(m.target)
        missing = []
        while not target.exists():
            missing.append(target)
            target = target.parent
        for path in reversed(missing):
            path.mkdir()
            created.append(path)
    return created


class ContainerProcess:
    """One run of a container (a restart is a new ContainerProcess)."""

    def __init__(self, argv: list[str], env: dict[str, str], mounts: list[Mount], read_only_root: bool,
                 working_dir: str, log_path: Path):
        script = mount_script(mounts, read_only_root, working_dir)
        self.argv = argv
        self.env = env
        with log_path.open("ab") as log:
            log.write(f"--- start: {shlex.join(argv)}\n".encode())
            log.flush()
            self.popen = subprocess.Popen(
                ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", script, "sh", *argv],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.pid = self.popen.pid

    def exit_code(self) -> int | None:
        return self.popen.poll()

    def signal(self, sig: int) -> None:
        if self.popen.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill_all(self) -> None:
        """SIGKILL to every process of the container (its session's process group), then reap PID 1."""
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.popen.wait(10)
        except subprocess.TimeoutExpired:
            pass

    def exec_hook(self, command: list[str], log_path: Path) -> subprocess.Popen:
        """An exec hook (preStop) inside the container's mount namespace, with the container's environment."""
        with log_path.open("ab") as log:
            log.write(f"--- exec hook: {shlex.join(command)}\n".encode())
            log.flush()
            return subprocess.Popen(["nsenter", f"--target={self.pid}", "--mount", "--", *command],
                                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                    start_new_session=True)
