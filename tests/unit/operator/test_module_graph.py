"""The operator's modules import each other without a circle (function-level imports included, so none can hide
one), and `disagg up` meets the operator through the plan API and the autoscaling pass only. Read from the
sources with ast, not from a hand-kept list."""
from __future__ import annotations

import ast
import importlib
from pathlib import Path

import disagg.operator
import disagg.worker.local

# what worker/local/ may import of the operator (docs/architecture.md: where things live)
LOCAL_MAY_IMPORT = {"disagg.operator.plan", "disagg.operator.autoscaling.scaling_pass"}


def modules(package) -> dict[str, Path]:
    """module name -> source file, for every module of `package` and its subpackages."""
    root = Path(package.__path__[0])
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join([package.__name__, *parts])] = path
    return out


def imported(path: Path, known: set[str]) -> set[str]:
    """The modules of `known` that the source at `path` imports, anywhere in it. `from a import b` counts as
    importing a.b when that is a module, else a."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            assert node.level == 0, f"{path}: relative import"
            subs = {f"{node.module}.{alias.name}" for alias in node.names}
            out |= (subs & known) or {node.module}
    return out & known


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as [a, b, ..., a], or None."""
    state: dict[str, str] = {}  # module -> "open" while on the DFS path, "done" after

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt, [*path, nxt])):
                return found
        state[node] = "done"
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start, [start])):
            return found
    return None


def test_the_cycle_finder_finds_a_circle():
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b"}, "b": set()}) is None


def test_every_operator_module_imports_and_none_import_in_a_circle():
    mods = modules(disagg.operator)
    assert {"disagg.operator.spec", "disagg.operator.plan", "disagg.operator.autoscaling.policy"} <= set(mods)
    for name in mods:
        importlib.import_module(name)
    graph = {name: imported(path, set(mods)) - {name} for name, path in mods.items()}
    assert graph["disagg.operator.manifests"] >= {"disagg.operator.plan"}, "the reader sees real edges"
    assert cycle(graph) is None, " -> ".join(cycle(graph) or [])


def test_the_spec_models_import_none_of_the_builders():
    mods = modules(disagg.operator)
    assert imported(mods["disagg.operator.spec"], set(mods)) <= {"disagg.operator.naming"}


def test_disagg_up_imports_only_the_plan_and_the_autoscaling_pass_of_the_operator():
    operator_modules = set(modules(disagg.operator))
    for name, path in modules(disagg.worker.local).items():
        assert imported(path, operator_modules) <= LOCAL_MAY_IMPORT, name
