"""The KV connectors that ship with disagg, each declared once: its name, its class, the settings it needs.

Everything that depends on which connector is chosen derives from these declarations: the factory's names
(factory.py), the worker's `--kv-*` flags (server/args.py), the names the CRD accepts (operator/spec.py) and the
flags the operator and `disagg up` put on a worker's command line (operator/worker_command.py). An out-of-tree
connector ("package.module:Class") needs no declaration; it gets its settings from --kv-connector-extra-config.

Standard library only: the operator image (no torch, no nixl) imports this module.
"""
from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

# what the command builder knows about where a worker runs (operator/worker_command.Placement's fields)
PlacementValue = Literal["advertise_host", "side_channel_port", "shared_storage_path"]
MODULE_PATH_PATTERN = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")
DEFAULT_LEASE_SECONDS = 30  # how long prefill keeps KV blocks nobody has pulled


@dataclass(frozen=True)
class ConnectorSetting:
    flag: str  # the worker's command-line flag, e.g. "--kv-side-channel-port"
    extra_key: str  # its key in KVTransferConfig.kv_connector_extra_config
    value_type: type  # argparse type
    help: str
    placement: PlacementValue  # which value of the worker's placement the command builder passes


@dataclass(frozen=True)
class ConnectorDeclaration:
    name: str  # the name users write in spec.kvTransfer.connector and --kv-connector
    target: str  # "package.module:Class", imported only when chosen (nixl is an optional dependency)
    settings: tuple[ConnectorSetting, ...] = ()
    # True: the workers must share a filesystem (on Kubernetes a ReadWriteMany PVC, spec.kvTransfer.sharedStorage)
    needs_shared_storage: bool = False
    # "package.module:function" that parses a request's kv_transfer_params, raising ValueError naming the bad
    # field; the HTTP layer calls it before the request reaches the engine (a 400, not a failed request)
    params_check: str | None = None


_SIDE_CHANNEL_HOST = ConnectorSetting(
    "--kv-side-channel-host", "side_channel_host", str,
    "NIXL side channel address: bound, and advertised to decode workers", "advertise_host")
_SIDE_CHANNEL_PORT = ConnectorSetting(
    "--kv-side-channel-port", "side_channel_port", int, "NIXL side channel port", "side_channel_port")
_SHARED_STORAGE_PATH = ConnectorSetting(
    "--kv-shared-storage-path", "shared_storage_path", str,
    "SharedStorageConnector directory, the same filesystem on every worker", "shared_storage_path")

CONNECTORS: dict[str, ConnectorDeclaration] = {d.name: d for d in (
    ConnectorDeclaration("NixlConnector", "disagg.worker.kv_transfer.nixl:NixlConnector",
                         (_SIDE_CHANNEL_HOST, _SIDE_CHANNEL_PORT),
                         params_check="disagg.worker.kv_transfer.nixl_params:parse_nixl_params"),
    # the same P/D hand-off fields as NIXL (do_remote_decode / do_remote_prefill + remote_*): malformed ones are a
    # 400 here too, although this connector finds the KV by the prompt's hash
    ConnectorDeclaration("SharedStorageConnector", "disagg.worker.kv_transfer.shared_storage:SharedStorageConnector",
                         (_SHARED_STORAGE_PATH,), needs_shared_storage=True,
                         params_check="disagg.worker.kv_transfer.nixl_params:parse_nixl_params"),
)}


def all_settings() -> list[ConnectorSetting]:
    """Every declared setting once (connectors may share one), in declaration order."""
    seen: dict[str, ConnectorSetting] = {}
    for declaration in CONNECTORS.values():
        for setting in declaration.settings:
            seen.setdefault(setting.flag, setting)
    return list(seen.values())


def declaration_of(connector: str) -> ConnectorDeclaration | None:
    """The declaration of a built-in connector; None for an out-of-tree 'module:Class' one."""
    return CONNECTORS.get(connector)


def params_check_of(connector: str | None) -> Callable[[dict], object] | None:
    """The declared kv_transfer_params check of a built-in connector (imported on first use), else None."""
    declaration = CONNECTORS.get(connector or "")
    if declaration is None or declaration.params_check is None:
        return None
    module, _, name = declaration.params_check.partition(":")
    return getattr(importlib.import_module(module), name)


def connector_problem(connector: str) -> str | None:
    """Why `connector` cannot be loaded by name, or None."""
    if connector in CONNECTORS or MODULE_PATH_PATTERN.fullmatch(connector):
        return None
    return (f"unknown connector {connector!r}: expected one of {', '.join(CONNECTORS)} "
            "or 'package.module:ClassName'")
