"""zeroshard's modules import each other without cycles (issue: one module per idea, each
importing only what sits below it). Function-local imports count; `if TYPE_CHECKING:` ones do
not, since they never run."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import zeroshard

PACKAGE_DIR = Path(zeroshard.__file__).parent


def _module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE_DIR.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING"
    )


def _imports(path: Path, known: set[str]) -> set[str]:
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()

    def resolve(name: str) -> None:
        # `from a.b import c` may name module a.b.c or attribute c of a.b: take the longest known.
        while name and name not in known:
            name = name.rpartition(".")[0]
        if name:
            found.add(name)

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                resolve(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")
                base = ".".join(base_parts[: len(base_parts) - node.level + 1])
                source = f"{base}.{node.module}" if node.module else base
            else:
                source = node.module or ""
            for alias in node.names:
                resolve(f"{source}.{alias.name}")
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(encoding="utf-8")))
    found.discard(module)
    # A package's __init__ is imported by every submodule import; that edge is not a cycle
    # of ideas, so it is left out (as the import system itself tolerates it).
    return {m for m in found if not module.startswith(m + ".")}


def _graph() -> dict[str, set[str]]:
    paths = sorted(PACKAGE_DIR.rglob("*.py"))
    known = {_module_name(p) for p in paths}
    return {_module_name(p): _imports(p, known) for p in paths}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def strongconnect(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            strongconnect(v)
    return found


def test_no_import_cycles_in_zeroshard() -> None:
    graph = _graph()
    assert len(graph) > 20, "the walker found too few modules to be looking at zeroshard"
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle() -> None:
    # The detector itself must be able to fail: a -> b -> c -> a is one cycle, d is alone.
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]


def test_the_walker_sees_function_local_imports(tmp_path, monkeypatch) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "x.py").write_text("def f():\n    from . import y\n")
    (package / "y.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import x\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE_DIR", package)
    graph = _graph()
    assert graph["pkg.x"] == {"pkg.y"}
    assert graph["pkg.y"] == set()
