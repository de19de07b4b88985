"""Moving a run between DeepSpeed and zeroshard: `zeroshard from-deepspeed` / `to-deepspeed`, and
the hook that lets `engine.load_checkpoint` read a DeepSpeed save directly."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

from zeroshard.checkpoint.base import CheckpointError
from zeroshard.checkpoint.deepspeed.portable import PortableState
from zeroshard.checkpoint.deepspeed.read_ds import is_deepspeed_tag_dir, read_deepspeed
from zeroshard.checkpoint.deepspeed.universal import UNIVERSAL_LATEST, is_universal_tag_dir, read_universal
from zeroshard.checkpoint.deepspeed.write_ds import write_deepspeed
from zeroshard.checkpoint.deepspeed.zs_format import read_zeroshard, write_zeroshard
from zeroshard.checkpoint.format import INDEX_FILE, read_latest, validate_tag


def deepspeed_tag_dir(ckpt_dir: str | os.PathLike, tag: str | None = None) -> Path | None:
    """The DeepSpeed tag directory `ckpt_dir` (+ `tag`, or its `latest`) names, or None when it
    is not a DeepSpeed checkpoint (a zeroshard one has an index.json)."""
    path = Path(ckpt_dir)
    candidates = [path] if tag is None else []
    if tag is not None:
        candidates.append(path / validate_tag(tag))
    elif not (path / INDEX_FILE).is_file():
        with contextlib.suppress(CheckpointError):
            latest = read_latest(path) or universal_latest(path)
            if latest is not None:
                candidates.append(path / latest)
    for candidate in candidates:
        if candidate.is_dir() and not (candidate / INDEX_FILE).is_file():
            if is_universal_tag_dir(candidate) or is_deepspeed_tag_dir(candidate):
                return candidate
    return None


def universal_latest(load_dir: str | os.PathLike, prefer: bool = False) -> str | None:
    """The tag `latest_universal` names (ds_to_universal writes it beside its output), when `prefer`
    (the config's `checkpoint.load_universal`) or when the save directory has no `latest`; else None."""
    path = Path(load_dir)
    if not (path / UNIVERSAL_LATEST).is_file() or (path / "latest").exists() and not prefer:
        return None
    tag = (path / UNIVERSAL_LATEST).read_text(encoding="utf-8", errors="replace").strip()
    try:
        return validate_tag(tag)
    except CheckpointError as error:
        raise CheckpointError(f"{path / UNIVERSAL_LATEST}: {error}") from None


def read_any_deepspeed(tag_dir: Path, allow_pickle: bool = False) -> PortableState:
    """A DeepSpeed tag directory, ZeRO or universal (`ds_to_universal` output)."""
    if is_universal_tag_dir(tag_dir):
        return read_universal(tag_dir, allow_pickle)
    return read_deepspeed(tag_dir, allow_pickle)


def _source(tag_dir: Path) -> Path:
    found = deepspeed_tag_dir(tag_dir)
    if found is None:
        raise CheckpointError(
            f"{tag_dir}: not a DeepSpeed checkpoint (no mp_rank_00_model_states.pt or "
            "zero_pp_rank_0_mp_rank_00_model_states.pt, nor a 'latest' or 'latest_universal' naming a tag "
            "directory that has one)."
        )
    return found


def from_deepspeed(src: str | os.PathLike, dst: str | os.PathLike, tag: str | None = None,
                   allow_pickle: bool = False) -> Path:
    """Convert DeepSpeed checkpoint `src` (a save directory or one tag's) into zeroshard checkpoint
    `dst/<tag>`; zeroshard then loads it on any world size and stage. Returns the tag directory."""
    tag_dir = deepspeed_tag_dir(src, tag) if tag is not None else _source(Path(src))
    if tag_dir is None:
        raise CheckpointError(f"{Path(src) / str(tag)}: not a DeepSpeed checkpoint tag directory.")
    state = read_any_deepspeed(tag_dir, allow_pickle)
    return write_zeroshard(state, dst, tag_dir.name, {"format": "deepspeed", "path": str(tag_dir)})


def to_deepspeed(src: str | os.PathLike, dst: str | os.PathLike, tag: str | None = None,
                 stage: int | None = None, world_size: int | None = None, allow_pickle: bool = False) -> Path:
    """Write zeroshard checkpoint `src` as a DeepSpeed 0.19 checkpoint `dst/<tag>` for `stage` and
    `world_size` (default: the ones the checkpoint records). Returns the tag directory."""
    state = read_zeroshard(src, tag, allow_pickle)
    if stage is not None:
        state.stage = int(stage)
    if world_size is not None:
        state.world_size = int(world_size)
    from zeroshard.checkpoint.format import resolve_checkpoint_dir

    name = resolve_checkpoint_dir(src, tag).name
    return write_deepspeed(state, dst, name.lstrip(".").removesuffix(".old") if name.startswith(".") else name)


@contextlib.contextmanager
def converted(tag_dir: Path, allow_pickle: bool) -> Iterator[Path]:
    """`tag_dir` (DeepSpeed) converted into a zeroshard tag directory that lives as long as the block.

    Every rank converts on its own, into its own temporary directory: no shared file system or
    collective is needed, and the conversion is deterministic, so every rank reads the same state.
    """
    state = read_any_deepspeed(tag_dir, allow_pickle)
    with tempfile.TemporaryDirectory(prefix="zeroshard-from-deepspeed-") as tmp:
        yield write_zeroshard(state, tmp, validate_tag(tag_dir.name), {"format": "deepspeed", "path": str(tag_dir)})
