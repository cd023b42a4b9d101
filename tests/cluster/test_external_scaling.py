"""spec.autoscaling.mode external: an HPA-style writer scales decode through the resource's /scale subresource (GET
the Scale, PATCH spec.replicas, as the HPA controller does); the operator applies it to the decode Deployment,
keeps prefill in step within prefillDecodeRatio, and runs no policy that would undo the writer's number."""
from __future__ import annotations

import time

import httpx
import pytest
from serving_helpers import NIXL_MISSING, nixl_available

from scenario import cr_manifest, delete_and_wait, live_pods, router_url, wait_ready, wait_router_pairs
from waiting import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not nixl_available(), reason=NIXL_MISSING)]

AUTOSCALING = {
    "enabled": True, "mode": "external", "intervalSeconds": 1,
    "prefill": {"minReplicas": 1, "maxReplicas": 2}, "decode": {"minReplicas": 1, "maxReplicas": 3},
    "prefillDecodeRatio": {"min": {"prefill": 1, "decode": 1}},  # a prefill pod per decode pod, up to prefill's max
}


def scale_url(cluster, name: str) -> str:
    return f"{cluster.api.url}/apis/disagg.dev/v1alpha1/namespaces/default/disaggregatedinferences/{name}/scale"


def pools(cluster, name: str) -> tuple[int, int]:
    """(prefill, decode) ready pods, when every live pod of both is ready."""
    def ready(role: str) -> int:
        pods = live_pods(cluster, name, role)
        up = [p for p in pods if any(c["type"] == "Ready" and c["status"] == "True"
                                     for c in (p.get("status") or {}).get("conditions", []))]
        return len(up) if len(up) == len(pods) else -1
    return ready("prefill"), ready("decode")


def test_an_hpa_style_writer_scales_decode_through_scale_and_prefill_follows(cluster, checkpoint):
    name = "external"
    cluster.apply(cr_manifest(name, checkpoint, autoscaling=AUTOSCALING))
    wait_ready(cluster, name)
    with httpx.Client(timeout=10) as hpa:
        scale = hpa.get(scale_url(cluster, name)).json()
        assert (scale["kind"], scale["spec"]["replicas"], scale["status"]["replicas"]) == ("Scale", 1, 1), scale
        assert "app.kubernetes.io/component=decode" in scale["status"]["selector"], scale

        # the writer wants 2 decode pods: both pools grow (prefill by the 1:1 ratio), and they serve
        r = hpa.patch(scale_url(cluster, name), json={"spec": {"replicas": 2}},
                      headers={"Content-Type": "application/merge-patch+json"})
        assert r.status_code == 200 and r.json()["spec"]["replicas"] == 2, r.text
        wait_for(lambda: pools(cluster, name) == (2, 2), 120, f"2 prefill + 2 decode pods\n{cluster.logs()}",
                 interval=0.5)
        wait_for(lambda: hpa.get(scale_url(cluster, name)).json()["status"]["replicas"] == 2, 30,
                 "status.decode.replicas through /scale", interval=0.5)
        wait_router_pairs(cluster, name)
        body = {"model": "tiny-llama", "prompt": "Hello", "max_tokens": 4, "temperature": 0}
        assert httpx.post(f"{router_url(cluster, name)}/v1/completions", json=body, timeout=60).status_code == 200

        # the operator keeps the writer's number: no policy of its own scales it back (idle, min 1)
        time.sleep(4)
        assert pools(cluster, name) == (2, 2) and cluster.cr(name)["spec"]["decode"]["replicas"] == 2
        assert "autoscaling" not in (cluster.cr(name).get("status") or {})

        # and down again: decode 1, prefill follows
        hpa.patch(scale_url(cluster, name), json={"spec": {"replicas": 1}},
                  headers={"Content-Type": "application/merge-patch+json"}).raise_for_status()
        wait_for(lambda: pools(cluster, name) == (1, 1), 90, f"1 prefill + 1 decode pod\n{cluster.logs()}",
                 interval=0.5)
    delete_and_wait(cluster, name)
