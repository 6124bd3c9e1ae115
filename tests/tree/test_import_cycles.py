"""Imports run one way (apps -> engine -> helexa_kernels) and never in a loop.

Read from the source with `ast`, nothing imported: an edge is a module-level import (also inside a
module-level `if`/`try`, but not under `if TYPE_CHECKING:`, and not inside a function, where an
import runs only when called). Importing `a.b.c` also runs the `__init__` of `a` and `a.b`.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

from tests.support import REPO

PACKAGES = ("apps", "engine", "helexa_kernels")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_modules() -> dict[str, Path]:
    return {module_name(path): path for package in PACKAGES for path in (REPO / package).rglob("*.py")}


def _is_type_checking(test: ast.expr) -> bool:
    return ((isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
            or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def module_level_imports(body: list[ast.stmt]) -> Iterator[ast.Import | ast.ImportFrom]:
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If):
            if not _is_type_checking(node.test):
                yield from module_level_imports(node.body)
            yield from module_level_imports(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody, *(h.body for h in node.handlers)):
                yield from module_level_imports(block)


def all_imports(tree: ast.Module) -> Iterator[ast.Import | ast.ImportFrom]:
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node


def imported_modules(name: str, path: Path, modules: dict[str, Path], *, anywhere: bool = False) -> set[str]:
    """The project modules that importing `name` runs first (each target and its packages); with
    `anywhere`, also those its functions import when called."""
    tree = ast.parse(path.read_text())
    targets: list[str] = []
    for node in (all_imports(tree) if anywhere else module_level_imports(tree.body)):
        if isinstance(node, ast.Import):
            targets += [alias.name for alias in node.names]
            continue
        base = node.module or ""
        if node.level:
            package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
            package = package[:len(package) - node.level + 1]
            base = ".".join([*package, base] if base else package)
        targets.append(base)
        # `from package import module` imports the module too.
        targets += [f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in modules]
    found = set()
    for target in targets:
        parts = target.split(".")
        found.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return {module for module in found if module in modules and module != name}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One loop of the graph (its modules, first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_find_cycle_sees_a_loop() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_runtime_import_cycle() -> None:
    modules = project_modules()
    graph = {name: imported_modules(name, path, modules) for name, path in modules.items()}
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def upward_imports(lower: str, higher: tuple[str, ...]) -> set[tuple[str, str]]:
    modules = project_modules()
    return {(name, target) for name, path in modules.items() if name.split(".")[0] == lower
            for target in imported_modules(name, path, modules, anywhere=True) if target.split(".")[0] in higher}


def test_kernels_import_neither_engine_nor_apps() -> None:
    assert not upward_imports("helexa_kernels", ("engine", "apps"))


def test_engine_does_not_import_apps() -> None:
    assert not upward_imports("engine", ("apps",))
