"""A model from the Hugging Face Hub (a local Hub-compatible server behind a token): the pods' fetch-model init
container downloads it into the cache PVC with the token from a Secret, the workers serve it, and a pod added
later starts from the cache without asking the Hub."""
from __future__ import annotations

import tempfile
from pathlib import Path

import httpx
import pytest
from model_sources import HubServer
from serving_helpers import NIXL_MISSING, nixl_available

from cluster import NODE_PARENT
from scenario import MODEL, PROMPT, cr_manifest, delete_and_wait, live_pods, router_url, wait_ready
from waiting import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not nixl_available(), reason=NIXL_MISSING)]
NAME = "hub"


def test_hugging_face_source_downloads_with_the_secret_token_and_a_new_pod_reuses_the_cache(cluster, checkpoint):
    hub = HubServer()
    hub.add_repo("org/tiny", Path(checkpoint), token="hf_cluster_token")
    cache = Path(tempfile.mkdtemp(prefix="cluster-cache-", dir=NODE_PARENT))
    cluster.register_claim("model-cache", cache)
    with hub.running() as url:
        cluster.apply({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "hf-token", "namespace": "default"},
                       "stringData": {"HF_TOKEN": "hf_cluster_token"}})
        cr = cr_manifest(NAME, checkpoint)
        cr["spec"]["model"].update(cacheClaimName="model-cache", source={"huggingFace": {
            "repo": "org/tiny", "tokenSecret": "hf-token", "endpoint": url}})
        cluster.apply(cr)
        wait_ready(cluster, NAME, timeout=240)
        downloads = [r for r in hub.requests if "/resolve/" in r and r.startswith("GET")]
        assert downloads, hub.requests  # behind the token: the Secret reached the init container
        with httpx.Client(timeout=60) as http:
            r = http.post(f"{router_url(cluster, NAME)}/v1/completions",
                          json={"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0})
            assert r.status_code == 200, r.text

        seen = len(hub.requests)
        cluster.patch_cr(NAME, {"spec": {"decode": {"replicas": 2}}})
        wait_for(lambda: len([p for p in live_pods(cluster, NAME, "decode")
                              if any(c.get("type") == "Ready" and c.get("status") == "True"
                                     for c in (p.get("status") or {}).get("conditions") or [])]) == 2,
                 180, f"second decode pod Ready\n{cluster.logs()}", interval=0.5)
        assert len(hub.requests) == seen, hub.requests[seen:]  # the new pod found the checkpoint in the cache
        delete_and_wait(cluster, NAME)
