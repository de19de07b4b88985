"""Every file of the package that the package, the docs, the examples, the benchmarks or the
README name exists: a path written `zeroshard/.../name.py`, or in the package a path relative to
the package that starts with one of its folders (`optim/muon/groups.py`). Files move; comments
and pages must move with them."""

from __future__ import annotations

import re
from pathlib import Path

import zeroshard

PACKAGE_DIR = Path(zeroshard.__file__).parent
REPO = PACKAGE_DIR.parent
FULL = re.compile(r"(?<![\w/.\-])(zeroshard/[\w/\-]+\.py)\b")
RELATIVE = re.compile(r"(?<![\w/.\-])([a-z_]+/[\w/\-]+\.py)\b")


def texts() -> list[Path]:
    found = [*PACKAGE_DIR.rglob("*.py"), *(REPO / "docs").glob("*.md"), REPO / "README.md"]
    for folder in ("examples", "benchmarks", "scripts"):
        found += [p for p in (REPO / folder).rglob("*") if p.suffix in (".py", ".md", ".sh")]
    return found


def missing(path: Path, text: str, repo: Path) -> list[str]:
    """The package paths `text` (the contents of `path`) names that do not exist under `repo`."""
    package = repo / "zeroshard"
    folders = {p.name for p in package.iterdir() if p.is_dir()}
    gone = [ref for ref in FULL.findall(text) if not (repo / ref).exists()]
    if package in path.parents:  # inside the package, `grads/path.py` means zeroshard/grads/path.py
        gone += [
            ref for ref in RELATIVE.findall(text)
            if ref.split("/")[0] in folders and not (package / ref).exists()
        ]
    return gone


def test_every_named_package_file_exists() -> None:
    problems = {}
    for path in texts():
        gone = missing(path, path.read_text(encoding="utf-8"), REPO)
        if gone:
            problems[path.relative_to(REPO).as_posix()] = sorted(set(gone))
    assert problems == {}


def test_the_check_can_fail(tmp_path) -> None:
    (tmp_path / "zeroshard" / "grads").mkdir(parents=True)
    (tmp_path / "zeroshard" / "grads" / "path.py").write_text("")
    inside = tmp_path / "zeroshard" / "x.py"
    text = "see zeroshard/grads/path.py, zeroshard/grads/gone.py, grads/path.py, grads/old.py, trl/models/utils.py"
    assert missing(inside, text, tmp_path) == ["zeroshard/grads/gone.py", "grads/old.py"]
    assert missing(tmp_path / "docs" / "a.md", text, tmp_path) == ["zeroshard/grads/gone.py"]
