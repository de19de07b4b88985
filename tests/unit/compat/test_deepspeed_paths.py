"""DeepSpeed's import paths under zeroshard's names (issue 23, item 5 B).

Every name the migration guide's "Module level" table calls present imports the way a
DeepSpeed script writes it (`from deepspeed.utils import safe_get_full_grad` read as
`from zeroshard.utils import ...`), and the modules that exist only to give DeepSpeed's paths
(zeroshard/runtime, utils, module_inject, ops) are shims: imports, `__all__` and a docstring,
no code of their own, so each name there is the implementation itself.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

import zeroshard
from tests.unit.compat.test_migration_doc import _code, _present_rows

PACKAGE_DIR = Path(zeroshard.__file__).parent
SHIM_PACKAGES = ("runtime", "utils", "module_inject", "ops", "accelerator", "launcher")
SHIM_FILES = sorted(p for package in SHIM_PACKAGES for p in (PACKAGE_DIR / package).rglob("*.py"))


def _documented_present_paths() -> list[str]:
    """`deepspeed.a.b` paths of the present rows; bare names after the first take its prefix."""
    paths = []
    for row in _present_rows("Module level"):
        prefix = None
        for token in _code(row[0]):
            name = token.split("(")[0].strip().rstrip(":")
            if "*" in name:
                continue
            if name.startswith("deepspeed."):
                prefix = name.rsplit(".", 1)[0]
            else:
                name = f"{prefix}.{name}"
            paths.append(name)
    return paths


PATHS = _documented_present_paths()


def test_the_guide_lists_paths() -> None:
    assert len(PATHS) >= 20 and "deepspeed.comm.get_rank" in PATHS and "deepspeed.utils.safe_get_full_grad" in PATHS


@pytest.mark.parametrize("path", PATHS)
def test_documented_path_imports(path: str) -> None:
    zeroshard_path = "zeroshard" + path.removeprefix("deepspeed")
    try:  # `import deepspeed.comm`: a module
        importlib.import_module(zeroshard_path)
        return
    except ModuleNotFoundError as exc:
        if exc.name != zeroshard_path:
            raise
    module, _, name = zeroshard_path.rpartition(".")  # `from deepspeed.utils import x`: a name in a module
    assert hasattr(importlib.import_module(module), name), f"{path}: {module} has no {name}"


def _own_definitions(path: Path) -> list[str]:
    """What a shim may not hold: any statement but imports, `__all__ = [...]` and the docstring."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = []
    for i, node in enumerate(tree.body):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        if i == 0 and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) \
                and isinstance(node.value.value, str):
            continue
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["__all__"]:
            continue
        found.append(f"line {node.lineno}: {type(node).__name__}")
    found += [f"line {n.lineno}: {type(n).__name__} {n.name}" for n in ast.walk(tree)
              if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
    return found


def test_there_are_shims() -> None:
    assert len(SHIM_FILES) >= 15, [str(p) for p in SHIM_FILES]


@pytest.mark.parametrize("path", SHIM_FILES, ids=[str(p.relative_to(PACKAGE_DIR)) for p in SHIM_FILES])
def test_shim_defines_nothing(path: Path) -> None:
    assert _own_definitions(path) == [], f"{path.relative_to(PACKAGE_DIR)} holds code: move it to its concern"


@pytest.mark.parametrize("path", SHIM_FILES, ids=[str(p.relative_to(PACKAGE_DIR)) for p in SHIM_FILES])
def test_shim_exports_resolve(path: Path) -> None:
    rel = path.relative_to(PACKAGE_DIR.parent).with_suffix("")
    name = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
    module = importlib.import_module(name)
    missing = [n for n in getattr(module, "__all__", []) if not hasattr(module, n)]
    assert missing == []


def test_the_checker_finds_code() -> None:
    # The check itself must be able to fail.
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        bad = Path(tmp) / "bad.py"
        bad.write_text('"""doc"""\nimport os\n__all__ = []\nX = 1\ndef f():\n    pass\n', encoding="utf-8")
        assert _own_definitions(bad) == ["line 4: Assign", "line 5: FunctionDef", "line 5: FunctionDef f"]
