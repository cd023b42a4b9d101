"""The worker's layers import down, never up: the runner and the connectors take the engine's boundary types
from disagg.worker.outputs (and friends), so a connector or a runner change never drags the engine in, and the
model knows nothing of who runs it. Read from the sources (ast), TYPE_CHECKING imports included."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

WORKER = Path(__file__).resolve().parents[2] / "worker"


def imported_modules(path: Path) -> set[str]:
    """Every module an `import` or `from ... import` in the file names, at any depth (function bodies and
    `if TYPE_CHECKING:` blocks too); `from pkg import mod` also counts as pkg.mod."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def violations(layer: str, forbidden: tuple[str, ...], root: Path = WORKER) -> list[str]:
    found = []
    for path in sorted((root / layer).rglob("*.py")):
        for name in sorted(imported_modules(path)):
            if any(name == f or name.startswith(f + ".") for f in forbidden):
                found.append(f"{path.relative_to(root)} imports {name}")
    return found


@pytest.mark.parametrize("layer, forbidden", [
    ("runner", ("disagg.worker.engine",)),
    ("kv_transfer", ("disagg.worker.engine",)),
    ("model", ("disagg.worker.engine", "disagg.worker.runner", "disagg.worker.kv_transfer")),
])
def test_lower_layers_do_not_import_upward(layer, forbidden):
    assert violations(layer, forbidden) == []


def test_the_check_sees_imports_hidden_in_type_checking_blocks_and_functions(tmp_path):
    (tmp_path / "layer").mkdir()
    (tmp_path / "layer" / "m.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from disagg.worker.engine.request import Request\n"
        "def f():\n    from disagg.worker import engine\n")
    assert violations("layer", ("disagg.worker.engine",), tmp_path) == [
        "layer/m.py imports disagg.worker.engine", "layer/m.py imports disagg.worker.engine.request",
        "layer/m.py imports disagg.worker.engine.request.Request"]
