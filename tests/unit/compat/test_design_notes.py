"""The `[Note: ...]` blocks the code cites exist, and docs/design.md's index of them is true
(docs/design.md section 8, "Notes in the code"): every note in the index is defined in the file
it names, every note defined in the package is in the index, and every note cited anywhere in
the package, tests or docs is defined."""

from __future__ import annotations

import re
from pathlib import Path

import zeroshard

PACKAGE_DIR = Path(zeroshard.__file__).parent
REPO = PACKAGE_DIR.parent
DESIGN = REPO / "docs" / "design.md"
NOTE = re.compile(r"\[Note: ([^\]]+)\]")
# A definition opens a line (a docstring's first line, a comment, or a block of its own).
DEFINITION = re.compile(r'^\s*(?:"""|#\s*)?\[Note: ([^\]]+)\]')


def definitions(root: Path) -> dict[str, set[str]]:
    """Note title -> the files (relative to the repository) that define it."""
    found: dict[str, set[str]] = {}
    for path in sorted(root.rglob("*.py")):
        for line in path.read_text(encoding="utf-8").splitlines():
            match = DEFINITION.match(line)
            if match:
                found.setdefault(match.group(1), set()).add(path.relative_to(root.parent).as_posix())
    return found


def index(text: str) -> dict[str, str]:
    """The design document's table after `<!-- notes -->`: note title -> file."""
    block = text.split("<!-- notes -->", 1)[1]
    rows = re.findall(r"^\| (.+?) \| (zeroshard/\S+) \|$", block, re.M)
    return dict(rows)


def citations(paths: list[Path]) -> set[str]:
    """Every note title named in `paths` (a title broken over lines is joined)."""
    return {" ".join(t.split()) for path in paths for t in NOTE.findall(path.read_text(encoding="utf-8"))}


def test_the_index_matches_the_definitions() -> None:
    defined = definitions(PACKAGE_DIR)
    listed = index(DESIGN.read_text(encoding="utf-8"))
    assert len(listed) > 30
    wrong = {title: file for title, file in listed.items() if file not in defined.get(title, set())}
    assert wrong == {}, "notes the index places in a file that does not define them"
    assert sorted(set(defined) - set(listed)) == [], "notes defined in the package but missing from the index"


def test_every_cited_note_is_defined() -> None:
    tests = [p for p in (REPO / "tests").rglob("*.py") if p.name != Path(__file__).name]
    cited = citations([*PACKAGE_DIR.rglob("*.py"), *tests, *(REPO / "docs").glob("*.md")]) - {"..."}
    # A test scenario may define a note of its own (about the test, not the package).
    defined = set(definitions(PACKAGE_DIR)) | set(definitions(REPO / "tests"))
    assert sorted(cited - defined) == []


def test_the_checks_can_fail(tmp_path) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "a.py").write_text('"""[Note: real]\ntext, and see [Note: ghost]."""\n# [Note: comment one]\n')
    assert definitions(package) == {"real": {"pkg/a.py"}, "comment one": {"pkg/a.py"}}
    assert citations([package / "a.py"]) == {"real", "ghost", "comment one"}
    table = "<!-- notes -->\n| note | file |\n|---|---|\n| real | zeroshard/x.py |\n"
    assert index(table) == {"real": "zeroshard/x.py"}
