"""Handoff: the one parser of kv_transfer_params (HTTP layer, engine, connectors and router)."""
from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from disagg.worker.kv_transfer.handoff import Handoff, HandoffError, RemoteKV

REMOTE = {"do_remote_prefill": True, "remote_engine_id": "e1", "remote_block_ids": [0, 3], "remote_host": "h",
          "remote_port": 5600, "remote_request_id": "r1"}
# what vLLM 0.32's NixlConnector returns from a prefill (one list of block ids per KV-cache group)
VLLM_PREFILL_ANSWER = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[1, 2, 3]],
                       "remote_engine_id": "0a1b", "remote_request_id": "cmpl-x-0", "remote_host": "10.0.0.7",
                       "remote_port": 5600, "tp_size": 1, "dcp_size": 1, "pp_size": 1, "remote_num_tokens": 40,
                       "remote_blocks_expiry_time": None, "transfer_mode": "pull"}


@pytest.mark.parametrize("params, field", [
    ([1], None),
    ({"do_remote_decode": "yes"}, "do_remote_decode"),
    ({"do_remote_prefill": 1}, "do_remote_prefill"),
    ({"do_remote_decode": True, "do_remote_prefill": True}, None),
    ({**REMOTE, "remote_block_ids": "0,3"}, "remote_block_ids"),
    ({**REMOTE, "remote_block_ids": [-1]}, "remote_block_ids"),
    ({**REMOTE, "remote_block_ids": [2, 2]}, "remote_block_ids"),
    ({**REMOTE, "remote_block_ids": [True]}, "remote_block_ids"),
    ({**REMOTE, "remote_block_ids": [[1, 1]]}, "remote_block_ids"),
    ({**REMOTE, "remote_port": 70000}, "remote_port"),
    ({**REMOTE, "remote_port": True}, "remote_port"),
    ({**REMOTE, "remote_engine_id": ""}, "remote_engine_id"),
    ({**REMOTE, "remote_request_id": 7}, "remote_request_id"),
    ({k: v for k, v in REMOTE.items() if k != "remote_host"}, "remote_host"),
    ({**REMOTE, "remote_lease_expires_at": "soon"}, "remote_lease_expires_at"),
    ({"delivered_token_ids": []}, "delivered_token_ids"),
    ({"delivered_token_ids": [1, "2"]}, "delivered_token_ids"),
    ({"output_token_ids": [-3]}, "output_token_ids"),
])
def test_bad_params_name_the_field(params, field):
    with pytest.raises(ValueError) as e:
        Handoff.parse(params)
    assert isinstance(e.value, HandoffError) and e.value.field == field
    assert e.value.param == (f"kv_transfer_params.{field}" if field else "kv_transfer_params")
    assert (field or "kv_transfer_params") in str(e.value)


def test_remote_prefill_params_parse_into_a_frozen_dataclass():
    p = Handoff.parse({**REMOTE, "remote_lease_expires_at": 12, "tp_size": 1})  # unknown keys pass through
    assert p == Handoff(do_remote_prefill=True, remote=RemoteKV("e1", (0, 3), "h", 5600, "r1", 12.0),
                        extra={"tp_size": 1})
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.remote = None  # type: ignore[misc]


@pytest.mark.parametrize("params, expected", [
    ({}, Handoff()),
    ({"do_remote_decode": True}, Handoff(do_remote_decode=True)),
    ({"do_remote_prefill": False, "remote_port": "kept untouched without the flag"},
     Handoff(do_remote_prefill=False, extra={"remote_port": "kept untouched without the flag"})),
])
def test_params_without_remote_prefill_need_no_remote_fields(params, expected):
    assert Handoff.parse(params) == expected


@pytest.mark.parametrize("params", [REMOTE, VLLM_PREFILL_ANSWER, {"do_remote_decode": True},
                                    {**REMOTE, "remote_lease_expires_at": 1.5, "output_token_ids": [7]},
                                    {"delivered_token_ids": [4, 5]}, {"fake_remote": True, "fail": True}])
def test_a_hand_off_round_trips_unchanged(params):
    """A router carries any engine's hand-off: what it does not know it passes on as it came."""
    assert Handoff.parse(params).to_wire() == params


def test_vllm_grouped_block_ids_are_kept_grouped():
    h = Handoff.parse(VLLM_PREFILL_ANSWER)
    assert h.remote.block_ids == ((1, 2, 3),) and h.extra["tp_size"] == 1
    assert h.get("remote_num_tokens") == 40 and h.get("missing", "x") == "x"


def test_the_decode_hop_after_the_first_token_was_streamed():
    answer = Handoff.parse({**REMOTE, "output_token_ids": [9]})
    assert answer.delivering(answer.output_token_ids).to_wire() == {**REMOTE, "output_token_ids": [9],
                                                                    "delivered_token_ids": [9]}
    assert Handoff.delivered_only((9,)).to_wire() == {"delivered_token_ids": [9]}
    assert Handoff.prefill_request().to_wire() == {"do_remote_decode": True}


def test_declared_connector_keys_are_type_checked():
    with pytest.raises(HandoffError) as e:
        Handoff.parse({**REMOTE, "tp_size": "1"}, {"tp_size": int})
    assert e.value.field == "tp_size"
    assert Handoff.parse({**REMOTE, "tp_size": 2}, {"tp_size": int}).extra == {"tp_size": 2}


def test_importing_the_parser_pulls_neither_torch_nor_nixl():
    code = ("import sys; import disagg.worker.kv_transfer.handoff; "
            "print(sorted(m for m in ('torch', 'nixl') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
