"""No import circle in the router nor in the KV-events package: every import counts, at module level, inside a
function or under TYPE_CHECKING (a circle held apart by where an import stands is still a circle)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

WORKER = Path(__file__).resolve().parents[3] / "worker"
PACKAGES = {"disagg.worker.router": WORKER / "router", "disagg.worker.kv_events": WORKER / "kv_events"}


def import_graph(package: str, folder: Path) -> dict[str, set[str]]:
    """module -> the modules of the same package it imports."""
    modules = {package if p.stem == "__init__" else f"{package}.{p.stem}": p for p in sorted(folder.glob("*.py"))}
    graph = {}
    for name, path in modules.items():
        named: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                named.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the importing module's package up
                    parts = (name if path.stem == "__init__" else name.rpartition(".")[0]).split(".")
                    base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
                named.update([base, *(f"{base}.{alias.name}" for alias in node.names)])
        graph[name] = {m for m in named if m in modules and m != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as [a, b, ..., a], or None."""
    state: dict[str, str] = {}  # module -> "open" (on the path) | "done"
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        path.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == "open":
                return path[path.index(dep):] + [dep]
            if dep not in state and (cycle := visit(dep)):
                return cycle
        path.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_cycle_finder_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_circle(package):
    graph = import_graph(package, PACKAGES[package])
    assert len(graph) > 3, "the package's modules were not found"
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))
