"""A container's environment and command line as the kubelet builds them (pure functions).

Order and rules as Kubernetes: envFrom sources first, then env entries (later ones win); an env value may refer
to variables defined before it as $(VAR); command and args are expanded with the finished environment; `$$`
escapes a `$`; a reference to an undefined variable stays as written. valueFrom: fieldRef (downward API),
secretKeyRef and configMapKeyRef (`optional` honoured).
"""
from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")

# (kind "Secret" | "ConfigMap", name) -> its data as text, or None when it does not exist
SourceLookup = Callable[[str, str], dict[str, str] | None]


class ContainerConfigError(Exception):
    """The container cannot be created yet (kubelet reason CreateContainerConfigError), e.g. a missing Secret."""


def expand(text: str, env: dict[str, str]) -> str:
    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group(1)
        return env[name] if name in env else m.group(0)
    return _REF.sub(sub, text)


def field_value(pod: dict[str, Any], path: str) -> str:
    """The downward API's fieldRef.fieldPath values."""
    meta, spec, status = pod["metadata"], pod.get("spec") or {}, pod.get("status") or {}
    m = re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", path)
    if m:
        return (meta.get(m.group(1)) or {}).get(m.group(2), "")
    simple = {"metadata.name": meta.get("name"), "metadata.namespace": meta.get("namespace"),
              "metadata.uid": meta.get("uid"), "spec.nodeName": spec.get("nodeName"),
              "spec.serviceAccountName": spec.get("serviceAccountName"), "status.podIP": status.get("podIP"),
              "status.hostIP": status.get("hostIP")}
    if path not in simple:
        raise ContainerConfigError(f"fieldRef {path!r} is not supported by this kubelet")
    return str(simple[path] or "")


def _key_ref(ref: dict[str, Any], kind: str, lookup: SourceLookup) -> str | None:
    data = lookup(kind, ref["name"])
    if data is None or ref["key"] not in data:
        if ref.get("optional"):
            return None
        what = f'{kind.lower()} "{ref["name"]}"' if data is None else f'key {ref["key"]!r} in {kind} {ref["name"]!r}'
        raise ContainerConfigError(f"{what} not found")
    return data[ref["key"]]


def container_env(pod: dict[str, Any], container: dict[str, Any], lookup: SourceLookup) -> dict[str, str]:
    env: dict[str, str] = {}
    for source in container.get("envFrom") or []:
        kind, ref = ("Secret", source["secretRef"]) if "secretRef" in source else ("ConfigMap",
                                                                                   source["configMapRef"])
        data = lookup(kind, ref["name"])
        if data is None:
            if ref.get("optional"):
                continue
            raise ContainerConfigError(f'{kind.lower()} "{ref["name"]}" not found')
        env.update({source.get("prefix", "") + k: v for k, v in data.items()})
    for var in container.get("env") or []:
        value_from = var.get("valueFrom")
        if value_from is None:
            env[var["name"]] = expand(var.get("value", ""), env)
            continue
        if "fieldRef" in value_from:
            value: str | None = field_value(pod, value_from["fieldRef"]["fieldPath"])
        elif "secretKeyRef" in value_from:
            value = _key_ref(value_from["secretKeyRef"], "Secret", lookup)
        elif "configMapKeyRef" in value_from:
            value = _key_ref(value_from["configMapKeyRef"], "ConfigMap", lookup)
        else:
            raise ContainerConfigError(f"env {var['name']}: valueFrom {sorted(value_from)} is not supported")
        if value is not None:
            env[var["name"]] = value
    return env


def container_argv(container: dict[str, Any], env: dict[str, str], entrypoint: list[str]) -> list[str]:
    """command (else the image's entrypoint) + args, each expanded with `env`."""
    command = container.get("command") or entrypoint
    return [expand(a, env) for a in [*command, *(container.get("args") or [])]]
