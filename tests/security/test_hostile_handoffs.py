"""Hostile P/D hand-offs against real workers of one resource (its hand-off key in their environment, NIXL):
kv_transfer_params forged, unsigned, replayed, expired, made for another resource or without a lease end, sent
straight to a decode worker, are refused with a status naming what is wrong, and the host they name sees no
connection; the NIXL side channel gives no metadata without a token of the key; a notification from an agent
the KV was not handed to is ignored and counted while the KV stays for its reader."""
from __future__ import annotations

import dataclasses
import http.client
import time

import httpx
import pytest
from serving_helpers import NIXL_MISSING, metric, nixl_available

from disagg.worker.kv_transfer.handoff import Handoff, RemoteKV
from disagg.worker.kv_transfer.handoff_auth import HandoffSigner
from security_helpers import complete, kv_params

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not nixl_available(), reason=NIXL_MISSING)]



def prompt(n: int) -> list[int]:
    """Token ids of a prompt of 20 tokens (2 blocks of 16), a different one for each `n`: no test finds another's
    blocks in a worker's prefix cache."""
    return list(range(100 + 20 * n, 120 + 20 * n))


PROMPT_IDS = prompt(0)
NO_CONNECTION_WAIT_S = 1.5  # a worker's handshake runs in a background thread: give a wrong one time to show


@pytest.fixture(scope="module")
def fleet(tiny_model_dir, tmp_path_factory, handoff_env):
    from serving_fleet import Fleet

    f = Fleet(tmp_path_factory.mktemp("hostile-handoffs"))
    prefill = f.worker("prefill", "prefill", tiny_model_dir, "NixlConnector", lease_s=20, env=handoff_env)
    decode = f.worker("decode", "decode", tiny_model_dir, "NixlConnector", env=handoff_env)
    f.wait_ready()
    router = f.router([prefill], [decode])
    f.wait_ready()
    yield {"prefill": prefill, "decode": decode, "router": router}
    assert set(f.stop().values()) == {0}


def remote_kv(host: str, port: int, lease_in_s: float) -> RemoteKV:
    return RemoteKV("engine-x", (0, 1), host, port, "req-x", time.time() + lease_in_s)


def hand_off(remote: RemoteKV, signer: HandoffSigner | None) -> dict:
    h = Handoff(do_remote_prefill=True, remote=remote)
    return (signer.sign(h) if signer is not None else h).to_wire()


def test_signed_pd_through_the_router_moves_kv(fleet):
    r = complete(fleet["router"], {"prompt": prompt(3), "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200, r.text
    assert metric(fleet["decode"], "disagg:kv_bytes_loaded_total") > 0


@pytest.mark.parametrize("case, status, words", [
    ("unsigned", 403, "disagg_signature is missing"),
    ("another key", 403, "changed or forged"),
    ("changed host", 403, "changed or forged"),
    ("another resource", 403, "made for team-b/llama, not for team-a/llama"),
    ("expired", 403, "lease on this KV ended"),
    ("no lease end", 400, "remote_lease_expires_at is required"),
])
def test_a_hostile_hand_off_is_refused_and_its_host_sees_nothing(fleet, signer, bystander_factory, case, status,
                                                               words):
    target = bystander_factory(77)
    remote = remote_kv(target.host, target.port, 30)
    params = {
        "unsigned": lambda: hand_off(remote, None),
        "another key": lambda: hand_off(remote, HandoffSigner(b"z" * 32, "team-a/llama")),
        # a genuine signature over other values, pointed at the bystander
        "changed host": lambda: {**hand_off(remote_kv("127.0.0.1", 1, 30), signer), "remote_host": target.host,
                                 "remote_port": target.port},
        "another resource": lambda: hand_off(remote, HandoffSigner(signer.key, "team-b/llama")),
        "expired": lambda: hand_off(dataclasses.replace(remote, lease_expires_at=time.time() - 1), signer),
        "no lease end": lambda: {k: v for k, v in hand_off(remote, signer).items()
                                 if k != "remote_lease_expires_at"},
    }[case]()
    r = complete(fleet["decode"], {"prompt": PROMPT_IDS, "max_tokens": 2, "kv_transfer_params": params})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert words in error["message"] and error["code"] == status
    assert error["param"].startswith("kv_transfer_params.")
    time.sleep(NO_CONNECTION_WAIT_S)
    assert target.connections == 0, f"the decode worker connected to the host a {case} hand-off named"


def test_a_replayed_hand_off_is_refused_and_its_host_sees_no_second_connection(fleet, signer, bystander_factory):
    target = bystander_factory(78)
    params = hand_off(remote_kv(target.host, target.port, 30), signer)
    first = complete(fleet["decode"], {"prompt": prompt(4), "max_tokens": 2, "kv_transfer_params": params})
    assert first.status_code == 200, first.text  # genuine: it was tried (404 there), the prompt computed here
    seen = target.connections
    assert seen >= 1
    again = complete(fleet["decode"], {"prompt": prompt(4), "max_tokens": 2, "kv_transfer_params": params})
    assert again.status_code == 403 and "used already (a replay)" in again.json()["error"]["message"]
    time.sleep(NO_CONNECTION_WAIT_S)
    assert target.connections == seen


def _get_metadata(host: str, port: int, headers: dict[str, str]) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection(host, port, timeout=5)
    try:
        conn.request("GET", "/metadata", headers=headers)
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def test_the_side_channel_gives_metadata_only_for_a_token_of_the_key(fleet, signer):
    ids = prompt(1)
    params = kv_params(fleet["prefill"], ids)
    host, port = params["remote_host"], params["remote_port"]
    other = HandoffSigner(b"z" * 32, "team-a/llama")
    for headers in ({}, {"X-Disagg-Agent": "me"},
                    {"X-Disagg-Agent": "me", "X-Disagg-Token": other.token("metadata", "me")},
                    {"X-Disagg-Agent": "me", "X-Disagg-Token": signer.token("metadata", "someone-else")},
                    {"X-Disagg-Agent": "me", "X-Disagg-Token": signer.token("metadata", "me", time.time() - 300)}):
        status, body = _get_metadata(host, port, headers)
        assert status == 403 and b"agent_metadata" not in body, headers
    status, body = _get_metadata(host, port, {"X-Disagg-Agent": "me", "X-Disagg-Token": signer.token("metadata", "me")})
    assert status == 200 and b"agent_metadata" in body
    # the KV of that prefill answer stays until its lease: release it by reading it
    assert complete(fleet["decode"], {"prompt": ids, "max_tokens": 2, "kv_transfer_params": params}
                    ).status_code == 200


def release(prefill: str, params: dict) -> httpx.Response:
    return httpx.post(f"{prefill}/v1/kv/release", json={"kv_transfer_params": params}, timeout=30)


def test_only_a_hand_off_signed_for_its_kv_releases_it_and_only_once(fleet, signer):
    """The router's release call (a hand-off no decode took) frees the prefill's blocks now; a forged or tampered
    one frees nothing, and a second one finds nothing to free."""
    prefill = fleet["prefill"]
    released = metric(prefill, "disagg:kv_released_unread_total")
    params = kv_params(prefill, prompt(5))
    assert metric(prefill, "disagg:kv_pending_sends") == 1
    for forged in ({**params, "remote_block_ids": [0]},  # another request's blocks under this signature
                   Handoff.parse(params).to_wire() | {"disagg_signature": None},
                   HandoffSigner(b"z" * 32, "team-a/llama").sign(Handoff.parse(params)).to_wire()):
        r = release(prefill, forged)
        assert r.status_code == 403 and r.json()["error"]["param"] == "kv_transfer_params.disagg_signature", r.text
    assert release(prefill, {"remote_engine_id": "x"}).status_code == 400
    assert metric(prefill, "disagg:kv_pending_sends") == 1  # nothing freed by those
    r = release(prefill, params)
    assert r.status_code == 200 and r.json() == {"released": True, "request_id": params["remote_request_id"]}
    deadline = time.monotonic() + 5  # (the lease is 20 s)
    while metric(prefill, "disagg:kv_pending_sends") != 0:
        assert time.monotonic() < deadline, "the released KV is still pending"
        time.sleep(0.05)
    assert metric(prefill, "disagg:kv_released_unread_total") == released + 1
    again = release(prefill, params)
    assert again.status_code in (403, 404), again.text  # a replay of the signature, or nothing left to free
    assert httpx.get(f"{prefill}/health").status_code == 200


def test_a_notification_from_a_stranger_agent_is_ignored_and_the_kv_stays_for_its_reader(fleet, signer):
    from security_helpers import StrangerAgent

    prefill, decode = fleet["prefill"], fleet["decode"]
    rejected = metric(prefill, "disagg:kv_notifications_rejected_total")
    loaded = metric(decode, "disagg:kv_bytes_loaded_total")
    ids = prompt(2)
    params = kv_params(prefill, ids)
    assert metric(prefill, "disagg:kv_pending_sends") == 1
    req_id = params["remote_request_id"]
    with StrangerAgent(params["remote_host"], params["remote_port"], signer) as stranger:
        stranger.notify(req_id.encode())  # what an unsigned reader sends
        stranger.notify(signer.notification(req_id, "decode-agent-not-the-sender"))  # another agent's token
        deadline = time.monotonic() + 10
        while metric(prefill, "disagg:kv_notifications_rejected_total") < rejected + 2:
            assert time.monotonic() < deadline, "the prefill worker did not see the stranger's notifications"
            time.sleep(0.1)
    assert metric(prefill, "disagg:kv_pending_sends") == 1  # still held for the reader it was handed to
    r = complete(decode, {"prompt": ids, "max_tokens": 2, "temperature": 0, "kv_transfer_params": params})
    assert r.status_code == 200, r.text
    assert metric(decode, "disagg:kv_bytes_loaded_total") > loaded  # the real reader READ it
    deadline = time.monotonic() + 10
    while metric(prefill, "disagg:kv_pending_sends") != 0:  # and its notification released it
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert httpx.get(f"{prefill}/health").status_code == 200
