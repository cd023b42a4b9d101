"""Hostile clients against a resource from `kubectl apply`: a CR with spec.router.auth (its client key in a Secret
of the namespace) and the hand-off key Secret the operator makes for it. Through the router Service no key or a
wrong one is a 401 and the key is served over P/D (KV moved); the pods sign with their resource's Secret; a
client that reaches a decode pod directly (the emulated cluster enforces no NetworkPolicy: this is the layer under
it) with an unsigned or forged hand-off, or one signed with the key of another resource of the namespace, gets a
403 naming what is wrong, and the host it names - an address no pod owns - sees no connection.
One CR serving and one (no pods: only its Secret is needed) for all cases: the tier's time budget."""
from __future__ import annotations

import base64

import httpx
import pytest
from serving_helpers import NIXL_MISSING, metric, nixl_available

from hostile import Bystander, assert_refused, pointing_at, stranger
from scenario import MODEL, cr_manifest, delete_and_wait, live_pods, pod_url, router_url, wait_ready, \
    wait_router_pairs
from waiting import wait_for

from disagg.worker.kv_transfer.handoff import Handoff
from disagg.worker.kv_transfer.handoff_auth import HandoffSigner, decode_key

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not nixl_available(), reason=NIXL_MISSING)]
NAME, OTHER = "guarded", "other"
CLIENT_KEY = "sk-cluster-client"
BYSTANDER = 83  # 127.0.0.83: pod IPs are 127.A.B.x with A >= 10 (kubelet.IpPool)


def handoff_signer(cluster, name: str) -> HandoffSigner:
    """The key of the Secret the operator made for resource `name`, as its pods get it."""
    secret = wait_for(lambda: cluster.store.get_object("", "v1", "secrets", "default", f"{name}-handoff"), 30,
                      f"{name}'s hand-off key Secret", interval=0.2)
    return HandoffSigner(decode_key(base64.b64decode(secret["data"]["key"]).decode(), "Secret"), f"default/{name}")


@pytest.fixture(scope="module")
def resource(cluster, checkpoint):
    cluster.apply({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "clients"},
                   "stringData": {"api-key": CLIENT_KEY}})
    cluster.apply(cr_manifest(NAME, checkpoint, router={"auth": {"secretName": "clients"}}))
    cluster.apply(cr_manifest(OTHER, checkpoint, prefill={"replicas": 0}, decode={"replicas": 0},
                              router={"replicas": 0}))
    wait_ready(cluster, NAME)
    wait_router_pairs(cluster, NAME)
    yield {"router": router_url(cluster, NAME), "prefill": pod_url(live_pods(cluster, NAME, "prefill")[0]),
           "decode": pod_url(live_pods(cluster, NAME, "decode")[0]), "signer": handoff_signer(cluster, NAME),
           "other": handoff_signer(cluster, OTHER)}
    delete_and_wait(cluster, NAME)
    delete_and_wait(cluster, OTHER)


@pytest.fixture
def target():
    b = Bystander(BYSTANDER)
    yield b
    b.close()


def complete(url: str, prompt: str | list[int], headers: dict | None = None, **body) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 3,
                                                    "temperature": 0, **body}, headers=headers, timeout=60)


def test_the_router_wants_the_client_key_and_serves_it_over_p_d(resource):
    router, decode = resource["router"], resource["decode"]
    prompt = "long enough to fill one block of sixteen tokens or more, surely, at the router"
    for headers, words in (({}, "Authorization: Bearer"), ({"Authorization": "Bearer sk-wrong"}, "invalid API key")):
        r = complete(router, prompt, headers)
        assert r.status_code == 401 and words in r.json()["error"]["message"], r.text
        assert r.headers["www-authenticate"] == "Bearer"
    assert httpx.get(f"{router}/ready", timeout=10).status_code == 200  # the probes' routes stay open
    before = metric(decode, "disagg:kv_bytes_loaded_total")
    r = complete(router, prompt, {"Authorization": f"Bearer {CLIENT_KEY}"})
    assert r.status_code == 200, r.text
    assert metric(decode, "disagg:kv_bytes_loaded_total") > before


def test_the_pods_sign_with_their_resources_secret(resource):
    ids = list(range(500, 520))
    r = complete(resource["prefill"], ids, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    assert r.status_code == 200, r.text
    params = r.json()["kv_transfer_params"]
    resource["signer"].verify(Handoff.parse(params))  # signed for default/guarded with the Secret's key
    with pytest.raises(ValueError, match="made for default/guarded"):
        HandoffSigner(resource["other"].key, "default/other").verify(Handoff.parse(params))
    # the decode pod takes it (and reads the KV, releasing it)
    assert complete(resource["decode"], ids, max_tokens=2, kv_transfer_params=params).status_code == 200


@pytest.mark.parametrize("case, words", [
    ("unsigned", "disagg_signature is missing"),
    ("another key", "changed or forged"),
    ("another resource's Secret", "made for default/other, not for default/guarded"),
])
def test_a_hostile_hand_off_to_a_decode_pod_is_403_and_its_host_sees_nothing(resource, target, case, words):
    signer = {"unsigned": None, "another key": stranger("default/guarded"),
              "another resource's Secret": resource["other"]}[case]
    before = metric(resource["decode"], "disagg:kv_bytes_loaded_total")
    r = complete(resource["decode"], list(range(600, 620)), max_tokens=2,
                 kv_transfer_params=pointing_at(target.host, target.port, signer))
    assert_refused(r, 403, words, target)
    assert metric(resource["decode"], "disagg:kv_bytes_loaded_total") == before
