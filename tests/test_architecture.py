"""The package's shape, checked by parsing every module (imports inside functions included).

- the layers import downwards only: ``core`` imports nothing of the lab above it, workers
  import no experiment, nothing imports the top (runner, CLI, grading);
- no import cycle;
- one training loop: ``.backward(`` is called in three modules only (the loop, the
  ``no_sync`` probe, FLOP counting);
- one settings table: dict literals keyed by both "quick" and "full" live in ``core.profiles``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "lab_utils"

# Lowest first. A module may import its own layer and the layers below it.
LAYERS = ["core", "models", "middle", "workers", "experiments", "top"]
MIDDLE = {"store", "launcher"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def layer(mod: str) -> str:
    parts = mod.split(".")
    if len(parts) == 1:
        return "top"  # lab_utils/__init__.py
    if parts[1] in ("core", "models", "workers", "experiments"):
        return parts[1]
    return "middle" if parts[1] in MIDDLE else "top"


def lab_imports(path: Path, known: dict[str, Path]) -> set[str]:
    """The lab modules ``path`` imports anywhere in its body (``from pkg import mod`` resolved)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
        else:
            continue
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name.startswith("lab_utils"):
                out.add(name)
    out.discard(module_name(path))
    # a package's __init__ is imported with any of its modules: not an edge of its own
    return {m for m in out if not (known[m].name == "__init__.py" and m != "lab_utils" and
                                   any(o.startswith(m + ".") for o in out))}


GRAPH = {m: lab_imports(p, modules()) - {"lab_utils"} for m, p in modules().items()}


def test_layers_import_downwards_only():
    bad = [f"{m} ({layer(m)}) imports {d} ({layer(d)})"
           for m, deps in GRAPH.items() for d in deps
           if LAYERS.index(layer(d)) > LAYERS.index(layer(m))]
    assert not bad, "\n".join(sorted(bad))


def test_no_import_cycle():
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for d in sorted(GRAPH.get(m, ())):
            if state.get(d) == 1:
                return stack[stack.index(d):] + [d]
            if d not in state and (cycle := visit(d)):
                return cycle
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(GRAPH):
        if m not in state:
            cycle = visit(m)
            assert cycle is None, " -> ".join(cycle)


def calls_backward(path: Path) -> bool:
    return any(isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "backward"
               for n in ast.walk(ast.parse(path.read_text())))


def test_backward_in_three_modules():
    found = {m for m, p in modules().items() if calls_backward(p)}
    assert found <= {"lab_utils.core.loop", "lab_utils.core.comm_hooks", "lab_utils.core.flops"}, found


def keyed_by_both_profiles(path: Path) -> bool:
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Dict):
            keys = {k.value for k in node.keys if isinstance(k, ast.Constant)}
            if {"quick", "full"} <= keys:
                return True
    return False


def test_profile_values_in_one_module():
    found = {m for m, p in modules().items() if keyed_by_both_profiles(p)}
    assert found <= {"lab_utils.core.profiles"}, found


@pytest.mark.parametrize("mod", sorted(m for m in GRAPH if layer(m) == "core"))
def test_core_module_imports_only_core(mod):
    assert {d for d in GRAPH[mod] if layer(d) != "core"} == set()
