"""The package's folders stand on floors (docs/design.md, "The floors"): a folder imports only
folders on lower floors, or folders listed before it on its own floor, so no two folders import
each other and the dependency order can be read top to bottom. The floors are read from the
design document itself, so the document and the test cannot drift apart; a new top-level
folder fails here until it is given a floor. Function-local imports count; `if TYPE_CHECKING:`
ones do not (they never run)."""

from __future__ import annotations

import re
from pathlib import Path

import zeroshard
from tests.unit.compat.test_import_cycles import _graph

PACKAGE_DIR = Path(zeroshard.__file__).parent
DESIGN = PACKAGE_DIR.parent / "docs" / "design.md"
ROOT = "<root>"  # the package's own files: __init__.py, __main__.py, cli.py


def read_floors(text: str) -> list[list[str]]:
    """The floors, lowest first, from the fenced block that follows the `<!-- floors -->` marker:
    one line per floor, `name: folder folder ...`."""
    match = re.search(r"<!-- floors -->\s*```[a-z]*\n(.*?)```", text, re.S)
    assert match, "docs/design.md has no floors block (a fenced block after <!-- floors -->)"
    floors = []
    for line in match.group(1).strip().splitlines():
        _, _, folders = line.partition(":")
        floors.append(folders.split())
    return floors


def folder_of(module: str) -> str:
    parts = module.split(".")
    if len(parts) > 1 and (PACKAGE_DIR / parts[1]).is_dir():
        return parts[1]
    return ROOT


def folder_edges(graph: dict[str, set[str]]) -> dict[tuple[str, str], list[str]]:
    """(importing folder, imported folder) -> the module imports behind it."""
    edges: dict[tuple[str, str], list[str]] = {}
    for module, imported in graph.items():
        for target in imported:
            a, b = folder_of(module), folder_of(target)
            if a != b:
                edges.setdefault((a, b), []).append(f"{module} -> {target}")
    return edges


def violations(floors: list[list[str]], edges: dict[tuple[str, str], list[str]]) -> list[str]:
    """Every import of a folder that is not below the importer, and every mutual pair."""
    position = {folder: (level, index) for level, row in enumerate(floors) for index, folder in enumerate(row)}
    found = []
    for (a, b), why in sorted(edges.items()):
        if a not in position or b not in position:
            continue  # reported by test_every_folder_has_a_floor
        if position[b] >= position[a]:
            found.append(f"{a} imports {b}, which is not below it: {'; '.join(sorted(why)[:3])}")
        if (b, a) in edges and a < b:
            found.append(f"{a} and {b} import each other")
    return found


def test_every_folder_has_a_floor() -> None:
    floors = read_floors(DESIGN.read_text(encoding="utf-8"))
    listed = [folder for row in floors for folder in row]
    assert len(listed) == len(set(listed)), "a folder is listed twice"
    folders = {p.name for p in PACKAGE_DIR.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert folders | {ROOT} == set(listed), (
        f"folders without a floor: {sorted(folders - set(listed))}; listed but missing: "
        f"{sorted(set(listed) - folders - {ROOT})}"
    )


def test_no_folder_imports_a_folder_above_it() -> None:
    floors = read_floors(DESIGN.read_text(encoding="utf-8"))
    edges = folder_edges(_graph())
    assert len(edges) > 30, "too few folder imports found to be looking at zeroshard"
    assert violations(floors, edges) == []


def test_the_check_can_fail() -> None:
    # An upward import and a mutual pair are both reported; a downward one is not.
    floors = [["config", "comm"], ["sharding"], ["engine"]]
    edges = {("sharding", "engine"): ["a -> b"], ("engine", "sharding"): ["c -> d"], ("comm", "config"): ["e -> f"]}
    found = violations(floors, edges)
    assert any(line.startswith("sharding imports engine") for line in found)
    assert "engine and sharding import each other" in found
    assert not any(line.startswith("comm imports") for line in found)
    assert read_floors("<!-- floors -->\n```text\nground: a b\ntop: c\n```\n") == [["a", "b"], ["c"]]
