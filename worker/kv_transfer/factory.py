"""Connector factory: built-in connectors by registered name, out-of-tree ones by "module:Class"."""
from __future__ import annotations

import importlib

from disagg.worker.kv_transfer.base import KVCacheSpec, KVConnectorBase, KVConnectorRole, KVTransferConfig

# name -> "module:Class"; imported lazily so an optional dependency (nixl) is only needed when chosen
_REGISTRY: dict[str, str] = {
    "SharedStorageConnector": "disagg.worker.kv_transfer.shared_storage:SharedStorageConnector",
    "NixlConnector": "disagg.worker.kv_transfer.nixl:NixlConnector",
}


def registered_connectors() -> list[str]:
    return sorted(_REGISTRY)


def _load_class(target: str) -> type[KVConnectorBase]:
    module_name, _, class_name = target.partition(":")
    if not module_name or not class_name:
        raise ValueError(f"connector {target!r}: expected 'package.module:ClassName'")
    module = importlib.import_module(module_name)
    try:
        cls = getattr(module, class_name)
    except AttributeError:
        raise ValueError(f"connector {target!r}: module {module_name} has no class {class_name}") from None
    if not (isinstance(cls, type) and issubclass(cls, KVConnectorBase)):
        raise TypeError(f"connector {target!r} is not a subclass of KVConnectorBase")
    return cls


def resolve_connector_class(config: KVTransferConfig) -> type[KVConnectorBase]:
    if config.kv_connector_module_path:
        return _load_class(config.kv_connector_module_path)
    name = config.kv_connector
    if name and ":" in name:
        return _load_class(name)
    if name not in _REGISTRY:
        raise ValueError(
            f"unknown KV connector {name!r}: expected one of {', '.join(registered_connectors())} "
            "or 'package.module:ClassName'"
        )
    return _load_class(_REGISTRY[name])


def create_connector(
    config: KVTransferConfig, role: KVConnectorRole, kv_cache_spec: KVCacheSpec
) -> KVConnectorBase | None:
    if not config.kv_connector and not config.kv_connector_module_path:
        return None
    return resolve_connector_class(config)(config, role, kv_cache_spec)
