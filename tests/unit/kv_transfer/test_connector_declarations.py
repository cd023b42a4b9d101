"""A connector declared once (kv_transfer/connectors.py) reaches every place that depends on the connector: the
factory, the worker's flags and KV-transfer config, the names the CRD accepts, the pod command and the HTTP
params check. And an out-of-tree connector by module path needs no declaration at all."""
from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from disagg.operator import spec as s
from disagg.operator.checks import semantic_problems
from disagg.operator.placement import Placement
from disagg.operator.worker_command import build_worker_command
from disagg.worker.kv_transfer import connectors
from disagg.worker.kv_transfer.base import KVTransferConfig
from disagg.worker.kv_transfer.factory import resolve_connector_class
from disagg.worker.kv_transfer.shared_storage import SharedStorageConnector
from disagg.worker.server.args import kv_transfer_config, parse_worker_args
from disagg.worker.server.protocol import APIError, check_kv_transfer_params

ROOT = Path(__file__).resolve().parents[3]
LOCAL = yaml.safe_load((ROOT / "examples" / "local.yaml").read_text())["spec"]


class ExampleConnector(SharedStorageConnector):  # a real connector class for the factory to load
    pass


@pytest.fixture
def declared(monkeypatch):
    setting = connectors.ConnectorSetting("--kv-example-port", "example_port", int, "example port",
                                          "side_channel_port")
    declaration = connectors.ConnectorDeclaration("ExampleConnector", f"{__name__}:ExampleConnector", (setting,),
                                                  handoff_fields=(("example", str),))
    monkeypatch.setitem(connectors.CONNECTORS, declaration.name, declaration)
    return declaration


def spec_with(connector: str) -> s.DisaggregatedInferenceSpec:
    raw = copy.deepcopy(LOCAL)
    raw["kvTransfer"]["connector"] = connector
    return s.parse_spec(raw)


def test_a_declared_connector_is_accepted_started_and_loaded_by_name(declared):
    spec = spec_with("ExampleConnector")
    assert semantic_problems(spec, "local") == []
    argv = build_worker_command(spec, "decode", Placement("127.0.0.1", 8100, "127.0.0.1", 8101, "/m")).argv
    assert argv[argv.index("--kv-example-port") + 1] == "8101"
    args = parse_worker_args(argv[2:])
    config = kv_transfer_config(args)
    assert config.kv_connector == "ExampleConnector" and config.kv_connector_extra_config["example_port"] == 8101
    assert resolve_connector_class(config) is ExampleConnector
    with pytest.raises(APIError) as e:
        check_kv_transfer_params({"example": 1}, "ExampleConnector")
    assert e.value.status == 400 and "example" in e.value.message


def test_without_the_declaration_the_name_is_rejected_everywhere():
    assert [p.path for p in semantic_problems(spec_with("ExampleConnector"), "local")] == \
        ["spec.kvTransfer.connector"]
    with pytest.raises(ValueError, match="--kv-example-port"):
        parse_worker_args(["--kv-connector", "ExampleConnector", "--kv-example-port", "1"])
    with pytest.raises(ValueError, match="unknown KV connector 'ExampleConnector'"):
        resolve_connector_class(KVTransferConfig(kv_connector="ExampleConnector"))


def test_an_out_of_tree_connector_by_module_path_needs_no_declaration(tmp_path):
    path = f"{__name__}:ExampleConnector"
    spec = spec_with(path)
    assert semantic_problems(spec, "local") == []
    argv = build_worker_command(spec, "prefill", Placement("127.0.0.1", 8100, "127.0.0.1", 8101, "/m")).argv
    config = kv_transfer_config(parse_worker_args([*argv[2:], "--kv-connector-extra-config",
                                                   f'{{"shared_storage_path": "{tmp_path}"}}']))
    cls = resolve_connector_class(config)
    assert cls is ExampleConnector
    check_kv_transfer_params({"anything": True}, path)  # it checks its own params
