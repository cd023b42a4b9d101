"""Applying a JSON merge patch (RFC 7386) the way an API server does: shared by the test-side API servers."""
from __future__ import annotations

import copy
from typing import Any


def apply_merge_patch(target: Any, patch: Any) -> Any:
    """A new object: `patch` merged into `target`; None in the patch deletes a key."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = copy.deepcopy(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = apply_merge_patch(out.get(k), v)
    return out
