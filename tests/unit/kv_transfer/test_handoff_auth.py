"""The signed hand-off: what a decode worker refuses before it connects anywhere."""
from __future__ import annotations

import base64
import dataclasses

import pytest

from disagg.worker.kv_transfer.handoff import Handoff, RemoteKV
from disagg.worker.kv_transfer.handoff_auth import HandoffRejected, HandoffSigner, new_key, signer_from_env

NOW = 1_700_000_000.0
KEY = b"k" * 32
REMOTE = RemoteKV("engine-1", (4, 5, 6), "10.0.0.7", 5600, "req-1", NOW + 30)
SIGNER = HandoffSigner(KEY, "team-a/llama")


def answer(**remote) -> Handoff:
    return Handoff(do_remote_prefill=True, remote=dataclasses.replace(REMOTE, **remote))


def test_a_signed_hand_off_passes_once_then_is_a_replay():
    signer = HandoffSigner(KEY, "team-a/llama")
    signed = signer.sign(answer())
    assert signed.signature.startswith("v1:team-a/llama:")
    assert Handoff.parse(signed.to_wire()) == signed  # the signature survives the wire
    signer.verify(signed, NOW)
    with pytest.raises(HandoffRejected, match="used already"):
        signer.verify(signed, NOW + 1)


@pytest.mark.parametrize("change", [{"host": "10.6.6.6"}, {"port": 22}, {"block_ids": (4, 5, 7)},
                                    {"request_id": "req-2"}, {"engine_id": "engine-2"},
                                    {"lease_expires_at": NOW + 3600}])
def test_any_changed_field_breaks_the_signature(change):
    signed = SIGNER.sign(answer())
    forged = dataclasses.replace(signed, remote=dataclasses.replace(signed.remote, **change))
    with pytest.raises(HandoffRejected, match="changed or forged") as e:
        HandoffSigner(KEY, "team-a/llama").verify(forged, NOW)
    assert e.value.status == 403


@pytest.mark.parametrize("handoff, status, words", [
    (answer(), 403, "is missing"),
    (dataclasses.replace(answer(), signature="v1:team-a/llama:00ff"), 403, "changed or forged"),
    (dataclasses.replace(answer(), signature="garbage"), 403, "not a v1 signature"),
    (HandoffSigner(KEY, "team-b/llama").sign(answer()), 403, "made for team-b/llama, not for team-a/llama"),
    (HandoffSigner(b"x" * 32, "team-a/llama").sign(answer()), 403, "changed or forged"),
    (SIGNER.sign(answer(lease_expires_at=NOW - 5)), 403, "lease on this KV ended 5.0 s ago"),
    (dataclasses.replace(answer(lease_expires_at=None), signature="v1:team-a/llama:00"), 400, "is required"),
])
def test_what_is_refused_and_how_it_is_said(handoff, status, words):
    with pytest.raises(HandoffRejected, match=words) as e:
        HandoffSigner(KEY, "team-a/llama").verify(handoff, NOW)
    assert e.value.status == status


def test_a_hand_off_without_remote_kv_needs_no_signature():
    SIGNER.verify(Handoff(delivered_token_ids=(3,)), NOW)
    SIGNER.verify(Handoff.prefill_request(), NOW)


def test_vllm_grouped_block_ids_are_signed_too():
    signed = SIGNER.sign(answer(block_ids=((1, 2),)))
    HandoffSigner(KEY, "team-a/llama").verify(Handoff.parse(signed.to_wire()), NOW)


def test_tokens_prove_the_key_for_one_purpose_and_subject_for_a_minute():
    token = SIGNER.token("metadata", "agent-7", NOW)
    assert SIGNER.check_token(token, "metadata", "agent-7", NOW + 5)
    assert not SIGNER.check_token(token, "metadata", "agent-8", NOW + 5)
    assert not SIGNER.check_token(token, "notify", "agent-7", NOW + 5)
    assert not SIGNER.check_token(token, "metadata", "agent-7", NOW + 120)
    assert not HandoffSigner(b"x" * 32, "team-a/llama").check_token(token, "metadata", "agent-7", NOW)
    assert not SIGNER.check_token("not-a-token", "metadata", "agent-7", NOW)


def test_keys_come_from_the_environment_or_a_file(tmp_path):
    assert signer_from_env({}) is None
    key = new_key()
    assert len(base64.b64decode(key)) == 32
    s = signer_from_env({"DISAGG_HANDOFF_KEY": key, "DISAGG_HANDOFF_RESOURCE": "ns/r"})
    assert s.resource == "ns/r" and s.key == base64.b64decode(key)
    (tmp_path / "key").write_text(key + "\n")
    assert signer_from_env({"DISAGG_HANDOFF_KEY_FILE": str(tmp_path / "key")}).key == s.key
    with pytest.raises(ValueError, match="base64"):
        signer_from_env({"DISAGG_HANDOFF_KEY": "not base64!"})
    with pytest.raises(ValueError, match="at least 16"):
        HandoffSigner(b"short", "ns/r")


def test_a_notification_releases_only_when_signed_for_the_agent_nixl_names_as_its_sender():
    msg = SIGNER.notification("req-1#0", "decode-agent", NOW)
    assert SIGNER.check_notification(msg, "decode-agent", NOW + 2) == "req-1#0"
    assert SIGNER.check_notification(msg, "stranger", NOW + 2) is None  # another agent replaying it
    assert SIGNER.check_notification(b"req-1#0", "decode-agent", NOW) is None  # unsigned (a peer without the key)
    forged = HandoffSigner(b"x" * 32, "team-a/llama").notification("req-1#0", "stranger", NOW)
    assert SIGNER.check_notification(forged, "stranger", NOW) is None
    assert SIGNER.check_notification(msg.replace(b"req-1#0", b"req-2#0"), "decode-agent", NOW) is None
    assert SIGNER.check_notification(msg, "decode-agent", NOW + 120) is None  # stale
    odd = SIGNER.notification("a|b", "c", NOW)  # separators inside the id stay unambiguous
    assert SIGNER.check_notification(odd, "c", NOW) == "a|b"
    assert SIGNER.check_notification(b"\xff\xfe", "c", NOW) is None


def test_a_prefill_answer_is_signed_only_when_it_names_remote_kv():
    wire = answer().to_wire() | {"tp_size": 1}
    signed = SIGNER.sign_params(wire)
    assert signed["tp_size"] == 1 and signed["disagg_signature"].startswith("v1:team-a/llama:")
    HandoffSigner(KEY, "team-a/llama").verify(Handoff.parse(signed), NOW)
    assert SIGNER.sign_params({"do_remote_decode": True}) == {"do_remote_decode": True}


def test_the_replay_cache_keeps_a_signature_only_while_its_lease_runs():
    signer = HandoffSigner(KEY, "team-a/llama")
    for i, lease in enumerate((NOW + 10, NOW + 40, NOW + 20)):
        signer.verify(SIGNER.sign(answer(request_id=f"req-{i}", lease_expires_at=lease)), NOW)
    late = SIGNER.sign(answer(request_id="req-9", lease_expires_at=NOW + 60))
    signer.verify(late, NOW + 25)  # the leases ending at +10 and +20 are over: those two are forgotten
    assert len(signer._seen) == 2
    with pytest.raises(HandoffRejected, match="used already"):
        signer.verify(late, NOW + 26)
