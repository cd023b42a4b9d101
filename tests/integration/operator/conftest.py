"""Fixtures: an emulated API server over real HTTP on 127.0.0.1 and the operator (kopf) in its own thread."""
from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from emulator import EmulatorThread, Kind
from operator_harness import CR, EXAMPLES, OperatorThread, quiesce

from disagg.operator import spec as s


@pytest.fixture
def cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[EmulatorThread]:
    with EmulatorThread() as api:
        api.emulator.declare(*CR, Kind(s.KIND, status_subresource=True, short_names=tuple(s.SHORT_NAMES)))
        with api.client() as http:  # kopf watching named namespaces looks them up
            http.post("/api/v1/namespaces", json={"metadata": {"name": "default"}}).raise_for_status()
        kubeconfig = tmp_path / "kubeconfig.yaml"
        kubeconfig.write_text(yaml.safe_dump(api.kubeconfig()))
        monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
        monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
        yield api


@pytest.fixture
def operator(cluster: EmulatorThread) -> Iterator[OperatorThread]:
    logging.getLogger("kopf").setLevel(logging.WARNING)
    op = OperatorThread().start()
    yield op
    quiesce(cluster)
    op.stop()


@pytest.fixture
def example() -> dict[str, Any]:
    return yaml.safe_load((EXAMPLES / "llama3-8b-gpu.yaml").read_text())
