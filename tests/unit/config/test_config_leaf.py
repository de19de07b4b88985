"""The config schema is a leaf (docs/design.md, "The floors"): the modules of zeroshard/config
import nothing of zeroshard outside zeroshard.config, function-local imports included. The
resolve pass, which runs the components' rules, is above them in zeroshard/resolve/. The names
the schema accepts for components (config/choices.py, config/optimizers.py) are each
component's own."""

from __future__ import annotations

import ast
from pathlib import Path

import zeroshard
from zeroshard.config import choices

CONFIG_DIR = Path(zeroshard.__file__).parent / "config"


def _zeroshard_imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: inside zeroshard.config unless it climbs out
                found.add("zeroshard.config" if node.level == 1 else "zeroshard")
            elif node.module:
                found |= {node.module} if node.module != "zeroshard" else {f"zeroshard.{a.name}" for a in node.names}
    return {m for m in found if m == "zeroshard" or m.startswith("zeroshard.")}


def _outside_config(path: Path) -> list[str]:
    inside = ("zeroshard.config", "zeroshard.config.")
    return sorted(m for m in _zeroshard_imports(path) if not (m == inside[0] or m.startswith(inside[1])))


def test_schema_modules_import_only_the_config() -> None:
    modules = sorted(CONFIG_DIR.glob("*.py"))
    assert {"schema.py", "sections.py", "base.py", "expert_parallel.py"} <= {p.name for p in modules}
    offenders = {p.name: _outside_config(p) for p in modules if _outside_config(p)}
    assert offenders == {}


def test_the_check_finds_a_component_import(tmp_path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text(
        "from zeroshard.config.base import _Section\n"
        "def f():\n    from zeroshard.optim import schedulers\n    import zeroshard.sharding.stages\n",
        encoding="utf-8",
    )
    assert _outside_config(bad) == ["zeroshard.optim", "zeroshard.sharding.stages"]


def test_accepted_names_are_the_components() -> None:
    from zeroshard.moe.autoep.presets import PRESETS
    from zeroshard.optim.schedulers import SCHEDULERS

    assert choices.SCHEDULER_TYPES == tuple(SCHEDULERS)
    assert choices.AUTOEP_PRESETS == tuple(PRESETS)
    assert choices.DEFAULT_COLLECTIVE_TIMEOUT_S == 600.0  # the default docs/reliability.md states
