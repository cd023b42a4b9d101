"""Hostile P/D hand-offs against `disagg up -f examples/local.yaml` (its router, 1 prefill, 1 decode over NIXL,
hand-offs signed with the key the run made): kv_transfer_params unsigned, forged, changed, made for another
resource, expired or without a lease end, sent by a client straight to the decode worker's URL, are refused with
a status naming what is wrong and the host they name sees no connection; a genuine hand-off taken from the
prefill worker is read once and refused when replayed; the router's signed P/D still moves KV.

`disagg up` has no client API keys (spec.router.auth names a Kubernetes Secret; the launcher passes none to its
router): tests/security/test_client_keys.py covers the router's keys, tests/cluster/test_security.py the CR's."""
from __future__ import annotations

import re
import time

import httpx
import pytest
import yaml
from serving_helpers import NIXL_MISSING, metric, nixl_available

from hostile import assert_refused, pointing_at, stranger
from security_helpers import REPO, complete, disagg_up, kv_params

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not nixl_available(), reason=NIXL_MISSING)]

LEASE_S = 6  # short: the expired case waits one out (long enough for a loaded machine to read within it)
RESOURCE = "local/local"  # the run's name (examples/local.yaml's metadata.name), as `disagg up` signs for it


@pytest.fixture(scope="module")
def up(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("up-hostile")
    doc = yaml.safe_load((REPO / "examples" / "local.yaml").read_text())
    doc["spec"]["kvTransfer"]["leaseSeconds"] = LEASE_S
    doc["spec"]["decode"]["replicas"] = 1
    with disagg_up(tmp, doc) as (port, text):
        assert "hand-offs: signed with a key made for this run" in text()
        urls = dict(re.findall(r"(\S+)\s+ready\s+(http://\S+)", text()))
        yield {"router": f"http://127.0.0.1:{port}", "prefill": urls["prefill-0"], "decode": urls["decode-0"]}


def prompt(n: int) -> list[int]:
    """20 token ids, other ones for each `n`: no case finds another's blocks in a prefix cache."""
    return list(range(300 + 20 * n, 320 + 20 * n))


def loaded(up) -> float:
    return metric(up["decode"], "disagg:kv_bytes_loaded_total")


def test_the_routers_signed_p_d_moves_kv(up):
    before = loaded(up)
    r = httpx.post(f"{up['router']}/v1/completions", json={"model": "tiny-llama", "prompt": prompt(0),
                                                            "max_tokens": 3, "temperature": 0}, timeout=60)
    assert r.status_code == 200, r.text
    assert loaded(up) > before


@pytest.mark.parametrize("case, status, words", [
    ("unsigned", 403, "disagg_signature is missing"),
    ("another key", 403, "changed or forged"),
    ("genuine, host changed", 403, "changed or forged"),
    ("another resource", 403, f"made for team-b/llama, not for {RESOURCE}"),
    ("no lease end", 400, "remote_lease_expires_at is required"),
])
def test_a_hostile_hand_off_to_the_decode_worker_is_refused_and_its_host_sees_nothing(up, bystander_factory, case,
                                                                                     status, words):
    target = bystander_factory(81)
    at = (target.host, target.port)
    params = {
        "unsigned": lambda: pointing_at(*at, None),
        "another key": lambda: pointing_at(*at, stranger(RESOURCE)),
        # the prefill worker's own signed answer, pointed at the bystander
        "genuine, host changed": lambda: {**kv_params(up["prefill"], prompt(1)), "remote_host": target.host,
                                          "remote_port": target.port},
        "another resource": lambda: pointing_at(*at, stranger("team-b/llama")),
        "no lease end": lambda: {k: v for k, v in pointing_at(*at, stranger(RESOURCE)).items()
                                 if k != "remote_lease_expires_at"},
    }[case]()
    before = loaded(up)
    r = complete(up["decode"], {"prompt": prompt(2), "max_tokens": 2, "kv_transfer_params": params})
    assert_refused(r, status, words, target)
    assert loaded(up) == before


def test_a_genuine_hand_off_is_read_once_its_replay_and_its_expiry_refused(up):
    params = kv_params(up["prefill"], prompt(3))
    before = loaded(up)
    body = {"prompt": prompt(3), "max_tokens": 2, "temperature": 0, "kv_transfer_params": params}
    assert complete(up["decode"], body).status_code == 200
    assert loaded(up) > before
    read = loaded(up)
    assert_refused(complete(up["decode"], body), 403, "used already (a replay)")
    late = kv_params(up["prefill"], prompt(4))  # taken, then held past its lease
    time.sleep(max(0.0, late["remote_lease_expires_at"] - time.time()) + 0.2)
    assert_refused(complete(up["decode"], {**body, "prompt": prompt(4), "kv_transfer_params": late}), 403,
                   "lease on this KV ended")
    assert loaded(up) == read
    assert httpx.get(f"{up['decode']}/health").status_code == 200
