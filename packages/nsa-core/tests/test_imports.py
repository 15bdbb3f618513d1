"""nsa-core's modules import one another without a circle, and never import nsa_kernels or
triton: the reference stands alone (docs/architecture.md)."""

from __future__ import annotations

import ast
from pathlib import Path

import nsa_core

PACKAGE_ROOT = Path(nsa_core.__file__).parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> dict[str, set[str]]:
    """Module -> the nsa_core modules it imports (every import statement, typing-only and
    in-function ones included; ``from pkg import name`` counts as the module ``pkg.name``
    where there is one, else as ``pkg``)."""
    modules = {_module_name(p): p for p in PACKAGE_ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    targets.add(full if full in modules else node.module)
        graph[name] = targets
    return graph


def test_no_module_of_nsa_core_imports_kernels_or_triton() -> None:
    for module, targets in _imports().items():
        foreign = {t for t in targets if t.split(".")[0] in ("nsa_kernels", "triton")}
        assert not foreign, f"{module} imports {sorted(foreign)}"


def test_no_import_circle_inside_nsa_core() -> None:
    """The package's own __init__ (which imports the public API from every module) is left
    out: Python runs it before any submodule, so it closes no circle."""
    graph = {
        module: {t for t in targets if t in _imports() and t != "nsa_core"}
        for module, targets in _imports().items()
        if module != "nsa_core"
    }
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        path.append(module)
        for target in sorted(graph.get(module, ())):
            if state.get(target) == 1:
                circle = [*path[path.index(target) :], target]
                raise AssertionError("import circle: " + " -> ".join(circle))
            if target not in state:
                visit(target)
        path.pop()
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)
