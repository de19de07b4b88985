"""Editing a saved checkpoint the way an attacker or a damaged disk would, for the trust tests.

An attacker who can write the directory can also recompute every checksum the checkpoint
records, so `rewrite_index` and `replace_file` keep the index's file table and the index
digest consistent with the edit: the loader's own checks, not a stale checksum, must catch it.
No tests here; module level so pooled workers can import it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from safetensors import safe_open
from safetensors.torch import save_file

from zeroshard.checkpoint.format import (
    INDEX_DIGEST_FILE,
    INDEX_FILE,
    file_digest,
    index_digest_text,
    rank_file_name,
)


def write_index_digest(tag_dir: Path) -> None:
    (tag_dir / INDEX_DIGEST_FILE).write_text(index_digest_text((tag_dir / INDEX_FILE).read_bytes()))


def rewrite_index(tag_dir: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    """Apply `edit` to the parsed index, write it back and record its new digest."""
    index = json.loads((tag_dir / INDEX_FILE).read_text())
    edit(index)
    (tag_dir / INDEX_FILE).write_text(json.dumps(index, indent=1))
    write_index_digest(tag_dir)


def register_file(tag_dir: Path, name: str) -> None:
    """Record file `name`'s current size and sha256 in the index (as if the saver wrote it)."""
    size, sha = file_digest(tag_dir / name)

    def edit(index: dict[str, Any]) -> None:
        index["files"][name] = {"size": size, "sha256": sha}

    rewrite_index(tag_dir, edit)


def rewrite_rank_file(
    tag_dir: Path,
    rank: int,
    tensors_edit: Callable[[dict[str, Any]], None] | None = None,
    metadata_edit: Callable[[dict[str, str]], None] | None = None,
) -> None:
    """Rewrite rank `rank`'s safetensors file with edited tensors or metadata, checksums updated."""
    path = tag_dir / rank_file_name(rank)
    with safe_open(str(path), framework="pt") as handle:
        tensors = {key: handle.get_tensor(key) for key in handle.keys()}
        metadata = dict(handle.metadata() or {})
    if tensors_edit is not None:
        tensors_edit(tensors)
    if metadata_edit is not None:
        metadata_edit(metadata)
    save_file(tensors, str(path), metadata=metadata)
    register_file(tag_dir, path.name)
