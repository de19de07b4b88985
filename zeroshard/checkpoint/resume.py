"""Resuming: the newest complete checkpoint in a save directory, loaded at this job's world
size and stage (`engine.resume_latest`, or `"preemption": {"resume": true}`).

[Note: a complete checkpoint]
A tag directory is complete when its last-written marker is there and right: `index.sha256`
(rank 0 writes it after `index.json`, which it writes after every rank reported its file
durable) holds the digest of `index.json`, and every file the index lists exists at the size
it records. A save killed half-way leaves `.<tag>.tmp` (never a candidate) or, if the save
machinery changes, a tag directory failing this test: both are skipped with a message. The
load itself still checks every byte (sha256 of each file, every field) before it changes
anything, and a checkpoint that fails there is skipped too: the next newest is tried. If
none loads, the newest one's error is raised (a model that fits none of them must not train
from the beginning unnoticed).

"Newest" is the highest `global_steps` the index records; on a tie, the tag `latest` names,
then the later index. The scan runs on rank 0 (the directory is shared); every rank tries the
same tags in the same order.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

from zeroshard.checkpoint.format import (
    INDEX_DIGEST_FILE,
    INDEX_FILE,
    LATEST_FILE,
    CheckpointError,
    validate_tag,
)
from zeroshard.checkpoint.sync import all_gather_object, is_rank_zero

logger = logging.getLogger("zeroshard")


def check_complete(tag_dir: Path) -> tuple[int, float]:
    """(global_steps, index mtime) of a complete checkpoint; CheckpointError saying why not."""
    digest_path, index_path = tag_dir / INDEX_DIGEST_FILE, tag_dir / INDEX_FILE
    if not digest_path.is_file():
        raise CheckpointError(f"{tag_dir}: no {INDEX_DIGEST_FILE} (the marker a save writes last): incomplete")
    data = index_path.read_bytes() if index_path.is_file() else None
    recorded = digest_path.read_text(encoding="utf-8", errors="replace").split()
    if data is None or not recorded or hashlib.sha256(data).hexdigest() != recorded[0]:
        raise CheckpointError(f"{tag_dir}: {INDEX_FILE} missing or not the one {INDEX_DIGEST_FILE} names: incomplete")
    try:
        index = json.loads(data)
        files = index["files"]
        steps = int(index["counters"]["global_steps"])
        for name, entry in files.items():
            path = tag_dir / name
            if os.path.basename(name) != name or not path.is_file() or path.stat().st_size != int(entry["size"]):
                raise CheckpointError(f"{path}: missing or not {entry['size']} bytes: incomplete")
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise CheckpointError(f"{index_path}: unreadable ({error!r})") from None
    return steps, index_path.stat().st_mtime


def find_complete(save_dir: str | os.PathLike) -> tuple[list[str], list[str]]:
    """(tags of complete checkpoints, newest first; a message for each directory skipped)."""
    save_dir = Path(save_dir)
    if not save_dir.is_dir():
        return [], []
    latest_path = save_dir / LATEST_FILE
    latest = latest_path.read_text(encoding="utf-8", errors="replace").strip() if latest_path.is_file() else None
    found: list[tuple[int, bool, float, str]] = []
    skipped: list[str] = []
    for entry in sorted(save_dir.iterdir()):
        name = entry.name
        if not entry.is_dir() or entry.is_symlink():
            continue
        if name.startswith(".") and name.endswith(".tmp"):
            skipped.append(f"{entry}: a save that did not finish (its temporary directory)")
            continue
        if name.startswith(".") and name.endswith(".old"):
            # The previous copy of a tag whose replacement died between its two renames;
            # load_checkpoint reads it under the tag's own name while the tag is missing.
            name = name[1:-4]
            if (save_dir / name).exists():
                continue
        try:
            validate_tag(name)
            steps, mtime = check_complete(entry)
        except (CheckpointError, OSError) as error:
            skipped.append(str(error))
            continue
        found.append((steps, name == latest, mtime, name))
    found.sort(reverse=True)
    return [tag for *_, tag in found], skipped


def resume_latest(engine: Any, load_dir: str | os.PathLike, **load_options: Any) -> tuple[str | None, Any]:
    """Load the newest complete checkpoint in `load_dir` into `engine`; collective.

    `load_options` are `load_checkpoint`'s (load_optimizer_states, ..., allow_pickle).

    Returns:
        (checkpoint directory, client_state), or (None, None) when there is none (a first
        start), as `load_checkpoint` does without a `latest` file.
    """
    from zeroshard.checkpoint.async_save import wait_for_checkpoint
    from zeroshard.checkpoint.load import load_checkpoint

    # A pending asynchronous save may be the newest checkpoint: the scan must see it published.
    wait_for_checkpoint(f"resume_latest({load_dir})")
    scan = find_complete(load_dir) if is_rank_zero() else None
    tags, skipped = all_gather_object(scan)[0]
    if is_rank_zero():
        for message in skipped:
            logger.warning("resume: skipping %s", message)
    first_error: BaseException | None = None
    for tag in tags:
        try:
            return load_checkpoint(engine, load_dir, tag=tag, **load_options)
        except (CheckpointError, OSError) as error:  # every rank raises together; nothing was changed
            first_error = first_error or error
            if is_rank_zero():
                logger.warning("resume: skipping %s: %s", Path(load_dir) / tag, error)
    if first_error is not None:
        # Complete checkpoints exist and none loads: this model or config does not fit them
        # (or all are damaged). Starting from the beginning would hide that.
        raise first_error
    if is_rank_zero():
        logger.info("resume: no complete checkpoint in %s; starting from the beginning.", load_dir)
    return None, None
