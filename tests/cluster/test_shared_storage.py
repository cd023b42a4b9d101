"""SharedStorageConnector on Kubernetes: the RWX PVC named in spec.kvTransfer.sharedStorage is mounted by every
prefill and decode pod where their command says, and the prompt's KV goes from prefill to decode through it."""
from __future__ import annotations

import tempfile
from pathlib import Path

import httpx
import pytest

from cluster import NODE_PARENT
from scenario import MODEL, PROMPT, cr_manifest, delete_and_wait, router_url, wait_ready, wait_router_pairs

pytestmark = [pytest.mark.slow]
NAME = "shared"


def test_shared_storage_connector_moves_kv_through_the_claim(cluster, checkpoint):
    volume = Path(tempfile.mkdtemp(prefix="cluster-kv-", dir=NODE_PARENT))
    cluster.register_claim("kv-shared", volume)
    cr = cr_manifest(NAME, checkpoint)
    cr["spec"]["kvTransfer"] = {"connector": "SharedStorageConnector", "leaseSeconds": 5,
                                "sharedStorage": {"claimName": "kv-shared"}}
    cluster.apply(cr)
    wait_ready(cluster, NAME)
    wait_router_pairs(cluster, NAME)
    with httpx.Client(timeout=60) as http:
        r = http.post(f"{router_url(cluster, NAME)}/v1/completions",
                      json={"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200, r.text
    written = [p for p in volume.rglob("*") if p.is_file()]
    assert written, "prefill wrote no KV to the shared claim"
    delete_and_wait(cluster, NAME)
