"""Only the comm package (zeroshard/comm/) calls torch.distributed collectives (docs/design.md section 9:
every collective names its group, so none may bypass comm's explicit-group functions)."""

from __future__ import annotations

import re
from pathlib import Path

import zeroshard

PACKAGE_DIR = Path(zeroshard.__file__).parent
COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_single", "all_gather_into_tensor", "reduce_scatter",
    "reduce_scatter_single", "reduce_scatter_tensor", "broadcast", "all_gather_object",
    "broadcast_object_list", "all_to_all", "all_to_all_single", "barrier", "reduce", "gather", "scatter",
    "send", "recv", "new_group",
)
CALL = re.compile(r"\b(?:dist|torch\.distributed)\.(" + "|".join(COLLECTIVES) + r")\s*\(")


def test_no_collective_outside_comm() -> None:
    offenders = []
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        if path.parent == PACKAGE_DIR / "comm":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if CALL.search(line):
                offenders.append(f"{path.relative_to(PACKAGE_DIR.parent)}:{number}: {line.strip()}")
    assert not offenders, "collectives outside zeroshard/comm/:\n" + "\n".join(offenders)
