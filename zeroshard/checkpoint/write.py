"""The file-writing half of a save, shared by synchronous saves (save.py) and the background
writer of asynchronous ones (async_save.py): everything here works on state already taken
from the engine, and none of it talks to other ranks.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from zeroshard.checkpoint.files import (
    finish_file,
    fsync_dir,
    remove_entry,
    write_bytes_exclusive,
    write_text_atomic,
)
from zeroshard.checkpoint.format import (
    EXTRAS_FILE,
    INDEX_DIGEST_FILE,
    INDEX_FILE,
    LATEST_FILE,
    PYTHON_STATE_FILE,
    file_digest,
    index_digest_text,
    old_tag_dir,
    rank_file_name,
)
from zeroshard.checkpoint.stream import StreamedSafetensors

# Test hook: "<point>@<rank>" makes that rank exit abruptly at that point of a save, as a
# killed process would. Points: "rank_file" (after writing its own file), "before_rename"
# (rank 0, after the index, before publishing the directory).
CRASH_ENV = "ZEROSHARD_CHECKPOINT_CRASH_AT"
CRASH_EXIT_CODE = 17

# Temporary directories of this process's saves that did not finish (rank 0). A save that
# fails part-way leaves `.<tag>.tmp`; the next save of any tag removes it. Only this
# process's own: another job may be saving into the same directory right now.
UNFINISHED: set[Path] = set()


def crash_point(point: str, rank: int) -> None:
    if os.environ.get(CRASH_ENV) == f"{point}@{rank}":
        os._exit(CRASH_EXIT_CODE)


def write_rank_file(tmp: Path, rank: int, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> dict[str, Any]:
    """Write and fsync `rank_<r>.safetensors`; its name, size and sha256 for the index. Streamed
    ([Note: streamed safetensors] in stream.py): a tensor on the device comes to the host only
    when its bytes are written, one at a time."""
    path = tmp / rank_file_name(rank)
    entries = [(name, t.dtype, tuple(t.shape)) for name, t in tensors.items()]
    with StreamedSafetensors(path, entries, metadata) as out:
        for name, tensor in tensors.items():
            out.write(name, tensor)
    finish_file(path)
    size, sha = file_digest(path)
    return {"file": path.name, "size": size, "sha256": sha}


@dataclass
class Rank0State:
    """What rank 0 writes besides its rank file, taken from the engine when the save is called:
    the index (its "files" entry is filled in once the files exist), the module extras, and
    the pickled Python state (None when everything is plain JSON)."""

    index: dict[str, Any]
    extras: dict[str, torch.Tensor]
    python_state: bytes | None


def write_rank0_files(tmp: Path, state: Rank0State, rank_files: list[dict[str, Any]]) -> None:
    """The module extras, python_state.pt, then the index (`rank_files`: every rank's file, size
    and sha256, in rank order) and its digest, all fsynced; the index last, so its presence
    means every file before it is complete."""
    files = {m["file"]: {"size": m["size"], "sha256": m["sha256"]} for m in rank_files}
    path = tmp / EXTRAS_FILE
    save_file(state.extras, str(path))
    finish_file(path)
    if state.python_state is not None:
        write_bytes_exclusive(tmp / PYTHON_STATE_FILE, state.python_state)
    for name in (EXTRAS_FILE, PYTHON_STATE_FILE) if state.python_state is not None else (EXTRAS_FILE,):
        size, sha = file_digest(tmp / name)
        files[name] = {"size": size, "sha256": sha}
    index = dict(state.index, files=files)
    index_bytes = (json.dumps(index, indent=1, default=str) + "\n").encode("utf-8")
    write_bytes_exclusive(tmp / INDEX_FILE, index_bytes)
    # The digest of the index, checked by every load (by tag or through `latest`).
    write_bytes_exclusive(tmp / INDEX_DIGEST_FILE, index_digest_text(index_bytes).encode("utf-8"))
    fsync_dir(tmp)


def publish(save_dir: Path, tag: str, tmp: Path, save_latest: bool) -> None:
    """Move the finished temporary directory to `save_dir/tag` and point `latest` at it."""
    final = save_dir / tag
    old = old_tag_dir(save_dir, tag)
    if final.exists():
        # Replacing a tag: the old copy stays loadable (as .<tag>.old) until the new one is in place.
        remove_entry(old)
        os.rename(final, old)
    os.rename(tmp, final)
    fsync_dir(save_dir)
    if save_latest:
        write_text_atomic(save_dir / LATEST_FILE, tag + "\n")
    remove_entry(old)
