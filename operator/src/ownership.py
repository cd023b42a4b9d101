"""Whose child an object is: the operator adopts an object of a child's name only when no other controller owns
it (an ownerReference with controller: true to something else), and removes only objects it controls.
Pure: decisions on objects as read.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ChildConflict:
    """An object with a child's name that another controller owns: left untouched, reported."""
    kind: str
    name: str
    owner_kind: str
    owner_name: str

    def __str__(self) -> str:
        return f"{self.kind} {self.name} is controlled by {self.owner_kind} {self.owner_name}"


def controller_reference(obj: dict[str, Any]) -> dict[str, Any] | None:
    """The ownerReference with controller: true (Kubernetes allows one), or None."""
    return next((ref for ref in obj.get("metadata", {}).get("ownerReferences") or [] if ref.get("controller")),
                None)


def conflict(kind: str, observed: dict[str, Any], owner_uid: str) -> ChildConflict | None:
    """Another controller owns `observed` (a `kind`); None when it is ours or has no controller (then it is
    adopted)."""
    ref = controller_reference(observed)
    if ref is None or ref.get("uid") == owner_uid:
        return None
    return ChildConflict(kind, observed["metadata"]["name"], ref.get("kind", "?"), ref.get("name", "?"))


def controlled_by(observed: dict[str, Any], owner_uid: str) -> bool:
    ref = controller_reference(observed)
    return ref is not None and ref.get("uid") == owner_uid
