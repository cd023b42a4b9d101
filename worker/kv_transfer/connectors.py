"""The KV connectors that ship with disagg, each declared once: its name, its class, the settings it needs.

Everything that depends on which connector is chosen derives from these declarations: the factory's names
(factory.py), the worker's `--kv-*` flags (server/args.py), the names the CRD accepts (operator/spec.py) and the
flags the operator and `disagg up` put on a worker's command line (operator/worker_command.py) and the hand-off
keys the HTTP layer checks (handoff.py). An out-of-tree
connector ("package.module:Class") needs no declaration; it gets its settings from --kv-connector-extra-config.

Standard library only: the operator image (no torch, no nixl) imports this module.
"""
from __future__ import annotations

import re
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
    # keys it reads from the P/D hand-off beyond the common ones (handoff.Handoff) -> their JSON type; the HTTP
    # layer checks them before the request reaches the engine (a 400 naming the key, not a failed request)
    handoff_fields: tuple[tuple[str, type], ...] = ()


_SIDE_CHANNEL_HOST = ConnectorSetting(
    "--kv-side-channel-host", "side_channel_host", str,
    "NIXL side channel address: bound, and advertised to decode workers (default 127.0.0.1; give the pod's "
    "address, not 0.0.0.0)", "advertise_host")
_SIDE_CHANNEL_PORT = ConnectorSetting(
    "--kv-side-channel-port", "side_channel_port", int, "NIXL side channel port", "side_channel_port")
_SHARED_STORAGE_PATH = ConnectorSetting(
    "--kv-shared-storage-path", "shared_storage_path", str,
    "SharedStorageConnector directory, the same filesystem on every worker", "shared_storage_path")

CONNECTORS: dict[str, ConnectorDeclaration] = {d.name: d for d in (
    ConnectorDeclaration("NixlConnector", "disagg.worker.kv_transfer.nixl:NixlConnector",
                         (_SIDE_CHANNEL_HOST, _SIDE_CHANNEL_PORT), handoff_fields=(("tp_size", int),)),
    # takes the common hand-off too (a router sends it), although it finds the KV by the prompt's hash
    ConnectorDeclaration("SharedStorageConnector", "disagg.worker.kv_transfer.shared_storage:SharedStorageConnector",
                         (_SHARED_STORAGE_PATH,), needs_shared_storage=True),
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


def handoff_fields_of(connector: str | None) -> dict[str, type]:
    """The hand-off keys a built-in connector declares it reads (none for an out-of-tree one)."""
    declaration = CONNECTORS.get(connector or "")
    return dict(declaration.handoff_fields) if declaration is not None else {}


def connector_problem(connector: str) -> str | None:
    """Why `connector` cannot be loaded by name, or None."""
    if connector in CONNECTORS or MODULE_PATH_PATTERN.fullmatch(connector):
        return None
    return (f"unknown connector {connector!r}: expected one of {', '.join(CONNECTORS)} "
            "or 'package.module:ClassName'")
