"""parse_nixl_params: the one check of NIXL kv_transfer_params (HTTP layer, engine and connector)."""
from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from disagg.worker.kv_transfer.nixl_params import NixlParams, NixlParamsError, parse_nixl_params

REMOTE = {"do_remote_prefill": True, "remote_engine_id": "e1", "remote_block_ids": [0, 3], "remote_host": "h",
          "remote_port": 5600, "remote_request_id": "r1"}


@pytest.mark.parametrize("params, field", [
    ([1], None),
    ({"do_remote_decode": "yes"}, "do_remote_decode"),
    ({"do_remote_prefill": 1}, "do_remote_prefill"),
    ({"do_remote_decode": True, "do_remote_prefill": True}, None),
    ({**REMOTE, "remote_block_ids": "0,3"}, "remote_block_ids"),
    ({**REMOTE, "remote_block_ids": [-1]}, "remote_block_ids"),
    ({**REMOTE, "remote_block_ids": [2, 2]}, "remote_block_ids"),
    ({**REMOTE, "remote_block_ids": [True]}, "remote_block_ids"),
    ({**REMOTE, "remote_port": 70000}, "remote_port"),
    ({**REMOTE, "remote_port": True}, "remote_port"),
    ({**REMOTE, "remote_engine_id": ""}, "remote_engine_id"),
    ({**REMOTE, "remote_request_id": 7}, "remote_request_id"),
    ({k: v for k, v in REMOTE.items() if k != "remote_host"}, "remote_host"),
    ({**REMOTE, "remote_lease_expires_at": "soon"}, "remote_lease_expires_at"),
])
def test_bad_params_name_the_field(params, field):
    with pytest.raises(ValueError) as e:
        parse_nixl_params(params)
    assert isinstance(e.value, NixlParamsError) and e.value.field == field
    assert e.value.param == (f"kv_transfer_params.{field}" if field else "kv_transfer_params")
    assert (field or "kv_transfer_params") in str(e.value)


def test_remote_prefill_params_parse_into_a_frozen_dataclass():
    p = parse_nixl_params({**REMOTE, "remote_lease_expires_at": 12, "tp_size": 1})  # unknown keys are ignored
    assert p == NixlParams(do_remote_prefill=True, remote_engine_id="e1", remote_block_ids=(0, 3), remote_host="h",
                           remote_port=5600, remote_request_id="r1", remote_lease_expires_at=12.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.remote_port = 1  # type: ignore[misc]


@pytest.mark.parametrize("params, expected", [
    ({}, NixlParams()),
    ({"do_remote_decode": True}, NixlParams(do_remote_decode=True)),
    ({"do_remote_prefill": False, "remote_port": "ignored without the flag"}, NixlParams()),
])
def test_params_without_remote_prefill_need_no_remote_fields(params, expected):
    assert parse_nixl_params(params) == expected


def test_importing_the_parser_pulls_neither_torch_nor_nixl():
    code = ("import sys; import disagg.worker.kv_transfer.nixl_params; "
            "print(sorted(m for m in ('torch', 'nixl') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
