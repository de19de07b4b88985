"""docs/migrating-from-deepspeed.md cannot drift from the code.

The key table must list every key the config models recognise, each in the class and model the
models put it in, and nothing else; every name the API tables call present must exist at the
place the table gives (`deepspeed.x.y` read as `zeroshard.x.y`, an engine name on a real engine),
and every name they call absent must not exist there, so a row cannot go stale either way.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest
import torch
from torch import nn

import zeroshard
from zeroshard.config.schema import ZeroshardConfig, _section_class

DOC = Path(__file__).resolve().parents[3] / "docs" / "migrating-from-deepspeed.md"


def _section(title: str) -> list[str]:
    """The lines under the heading `title` up to the next heading of the same or a higher level."""
    lines = DOC.read_text(encoding="utf-8").splitlines()
    start = next(i for i, line in enumerate(lines) if line.lstrip("#").strip() == title)
    level = len(lines[start]) - len(lines[start].lstrip("#"))
    end = next(
        (j for j in range(start + 1, len(lines))
         if lines[j].startswith("#") and len(lines[j]) - len(lines[j].lstrip("#")) <= level),
        len(lines),
    )
    return lines[start + 1:end]


def _table_rows(lines: list[str]) -> list[list[str]]:
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in lines if line.startswith("|")]
    return [r for r in rows[2:]]  # past the header and its rule


def _code(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def _classes_from_models() -> dict[str, tuple[str, str]]:
    """JSON path -> (class as the doc writes it, model name), for every key the models know."""
    found: dict[str, tuple[str, str]] = {}

    def walk(model: type, path: str) -> None:
        for name, field in model.model_fields.items():
            found[path + name] = ("no effect" if name in model.NO_EFFECT else "supported", model.__name__)
            sub = _section_class(field.annotation)
            if sub is not None:
                walk(sub, path + name + ".")
        for name in model.NOT_SUPPORTED:
            found[path + name] = ("refused", model.__name__)
        aliases = {**model.ALIASES, **getattr(model, "LEGACY_SECTIONS", {})}
        for name, target in aliases.items():
            found[path + name] = (f"alias of `{target}`", model.__name__)

    walk(ZeroshardConfig, "")
    return found


def test_key_table_matches_the_config_models():
    documented: dict[str, tuple[str, str]] = {}
    for row in _table_rows(_section("Config keys")):
        key, kind, model = _code(row[0])[0], row[1], _code(row[2])[0]
        assert key not in documented, f"{key} has two rows"
        documented[key] = (kind, model)
    actual = _classes_from_models()
    wrong = {k: (documented[k], actual[k]) for k in documented.keys() & actual.keys() if documented[k] != actual[k]}
    assert not wrong, f"rows whose class or model differ from the code (doc, code): {wrong}"
    unknown = documented.keys() - actual.keys()
    assert not unknown, f"rows for keys the config does not know: {unknown}"
    assert not actual.keys() - documented.keys(), f"keys without a row: {sorted(actual.keys() - documented.keys())}"


def _resolve(dotted: str):
    """`deepspeed.a.b.c` as zeroshard.a.b.c: the longest importable module, then attributes."""
    parts = ["zeroshard", *dotted.split(".")[1:]]
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(dotted)


def _rows(title: str, status: str) -> list[list[str]]:
    return [row for row in _table_rows(_section(title)) if row[1] == status]


def _present_rows(title: str) -> list[list[str]]:
    return _rows(title, "present")


def _module_names(row: list[str]) -> list[str]:
    """The dotted names of a module-level row; a bare name takes the prefix of the one before."""
    names, prefix = [], None
    for token in _code(row[0]):
        name = token.split("(")[0].strip()
        if "*" in name:
            continue  # a family, spelled out in the notes
        if name.startswith("deepspeed."):
            prefix = name.rsplit(".", 1)[0]
        else:
            assert prefix is not None, row
            name = f"{prefix}.{name}"
        names.append(name)
    return names


def test_present_module_names_exist():
    checked = 0
    for row in _present_rows("Module level"):
        for name in _module_names(row):
            _resolve(name)
            checked += 1
    assert checked >= 5


def test_absent_module_names_do_not_exist():
    names = [name for row in _rows("Module level", "absent") for name in _module_names(row)]
    assert len(names) >= 10
    present = []
    for name in names:
        try:
            _resolve(name)
        except (ImportError, AttributeError):
            continue
        present.append(name)
    assert not present, f"the doc says these are absent, but zeroshard has them: {present}"


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def _engine():
    model = _Tiny()
    engine, *_ = zeroshard.initialize(
        model=model, model_parameters=model.parameters(), dist_init_required=False,
        config={"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}},
    )
    return engine


def _engine_names(row: list[str]) -> list[str]:
    names = []
    for token in _code(row[0]):
        token = token.removeprefix("engine.")
        if "*" in token:
            continue  # a family, spelled out in the notes
        name = re.match(r"[A-Za-z_]\w*", token).group(0)
        if name != "engine":  # the call itself: engine(...)
            names.append(name)
    return names


def test_present_engine_names_exist():
    engine = _engine()
    checked = 0
    for row in _present_rows("Engine"):
        for name in _engine_names(row):
            assert hasattr(engine, name), f"the doc says engine.{name} is present"
            checked += 1
    assert checked >= 10


def test_absent_engine_names_do_not_exist():
    # Read through the attribute fallback too: a name the module answers is not absent.
    engine = _engine()
    names = [name for row in _rows("Engine", "absent") for name in _engine_names(row)]
    assert len(names) >= 3
    present = [name for name in names if hasattr(engine, name)]
    assert not present, f"the doc says engine.{present} are absent, but the engine answers them"


@pytest.mark.parametrize("title", ["Config keys", "Module level", "Engine", "Deliberate differences"])
def test_sections_exist(title):
    assert any(line.strip() for line in _section(title))
