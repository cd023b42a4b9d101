"""Connector factory: built-in connectors by their declared name (connectors.py), out-of-tree ones by
"module:Class"."""
from __future__ import annotations

import importlib

from disagg.worker.kv_transfer.base import (
    ConnectorMetric, KVCacheSpec, KVConnectorBase, KVConnectorRole, KVTransferConfig,
)
from disagg.worker.kv_transfer.connectors import CONNECTORS


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
    if name not in CONNECTORS:
        raise ValueError(
            f"unknown KV connector {name!r}: expected one of {', '.join(CONNECTORS)} "
            "or 'package.module:ClassName'"
        )
    return _load_class(CONNECTORS[name].target)


def create_connector(
    config: KVTransferConfig, role: KVConnectorRole, kv_cache_spec: KVCacheSpec
) -> KVConnectorBase | None:
    if not config.kv_connector and not config.kv_connector_module_path:
        return None
    return resolve_connector_class(config)(config, role, kv_cache_spec)


def exported_connector_metrics(config: KVTransferConfig | None = None) -> tuple[ConnectorMetric, ...]:
    """The connector metrics a worker exports: every built-in connector's (dashboards, alerts and the autoscaler
    read them from every worker, zero where another connector runs) and the configured connector's own."""
    classes = [_load_class(d.target) for d in CONNECTORS.values()]
    if config is not None and (config.kv_connector or config.kv_connector_module_path):
        classes.append(resolve_connector_class(config))
    return tuple(dict.fromkeys(m for cls in classes for m in cls.metrics))
