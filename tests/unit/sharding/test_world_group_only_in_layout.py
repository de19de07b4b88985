"""Only the comm package and the parallel layout name the world group (issue 23: one
`ParallelLayout` owns every parallel dimension). Everything else asks the layout
(`current_layout().world`, `engine.layout.world`), so no module builds groups of its own."""

from __future__ import annotations

import re
from pathlib import Path

import zeroshard

PACKAGE_DIR = Path(zeroshard.__file__).parent
ALLOWED = {PACKAGE_DIR / "sharding" / "layout.py"}
CALL = re.compile(r"\bworld_group\s*\(")


def test_world_group_called_only_in_comm_and_layout() -> None:
    offenders = []
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        if path.parent == PACKAGE_DIR / "comm" or path in ALLOWED:
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if CALL.search(line):
                offenders.append(f"{path.relative_to(PACKAGE_DIR.parent)}:{number}: {line.strip()}")
    assert not offenders, "world_group() outside zeroshard/comm/ and the layout:\n" + "\n".join(offenders)


def test_no_module_level_group_tables() -> None:
    """The former globals (expert groups, the sequence mpu's groups and mpu) are gone."""
    from zeroshard import groups
    from zeroshard.groups import sequence as sequence_groups
    from zeroshard.sequence import parallel_state_sp

    for module, name in ((groups, "_EXPERT_PARALLEL_GROUP"), (groups, "_EXPERT_DATA_PARALLEL_GROUP"),
                         (parallel_state_sp, "_GROUPS"), (sequence_groups, "_mpu")):
        assert not hasattr(module, name), f"{module.__name__}.{name}"
