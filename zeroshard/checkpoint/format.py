"""The on-disk checkpoint format: file names, the JSON index, and reading fragments back.

[Note: checkpoint layout]
A checkpoint is one directory per tag under the save directory:

    save_dir/
      latest                       the tag of the last complete checkpoint (one line)
      <tag>/
        index.json                 written by rank 0 last: everything below, described
        index.sha256               the sha256 of index.json, checked by every load
        rank_00000.safetensors     rank 0's fragments, optimizer state and RNG state
        rank_00001.safetensors     ...one per rank of the saving run
        module_extras.safetensors  rank 0: module buffers and frozen parameters
        python_state.pt            rank 0, only when client_state / the scheduler state
                                   is not plain JSON (torch.save pickle)

Each rank writes, for every flat buffer `flatK` of the engine, the slice of the buffer it
owns, `[rank * shard_numel, (rank + 1) * shard_numel)` in flat coordinates, as one 1-D
tensor per kind: `master/flatK` (master weights, master dtype), `state.<key>/flatK` (an
elementwise optimizer state: exp_avg, exp_avg_sq, momentum_buffer, ...) and
`scalar.<key>/flatK` (a 0-d optimizer state such as Adam's `step`). At stage 0 every rank
holds the whole buffer and still writes only its slice, so the I/O is spread evenly.

A parameter is contiguous in its flat buffer and a rank's slice is contiguous, so each
rank holds at most one piece (a *fragment*) of each parameter. The index maps every
parameter name to its fragments:

    "params": {"blocks.0.lin.weight": {
        "shape": [8, 8], "master_dtype": "float32", ...,
        "fragments": [{"rank": 0, "offset": 0, "numel": 40, "tensor": "flat1", "start": 12},
                      {"rank": 1, "offset": 40, "numel": 24, "tensor": "flat1", "start": 0}]}}

`offset` and `numel` are in the flattened parameter; `start` is where the fragment begins
in the rank's `master/flat1` tensor (and in its `state.*/flat1` tensors, which share the
layout). Padding is never saved: it is zero and stays zero, so a loader on any world size
rebuilds its own padding. Loading therefore never needs the saving run's flat layout, only
the parameter names; the flat layouts are recorded in the index for people who read it.

With tensor parallelism (index version 2) a split parameter keeps its whole `shape` and says
how it was cut, `"tensor_parallel": {"dim": 1, "parts": 2, "sub_sizes": null}`
([Note: tensor-parallel splits] in zeroshard/autotp/split.py); it is saved as its pieces, each
fragment naming its piece (`"tp_index"`), `offset` counted inside that piece. The fragments of
each piece tile it. A parameter tensor parallelism keeps whole is indexed from tensor rank 0's
files only. A loader at another tensor-parallel size assembles the pieces that overlap its own
(one parameter at a time) and cuts its piece out. Checkpoints without tensor parallelism stay
version 1, unchanged.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from zeroshard.autotp.split import TensorSplit
from zeroshard.checkpoint.base import CheckpointError, rank_file_name
from zeroshard.checkpoint.validate import check_index_geometry, flat_lengths
from zeroshard.sharding.ranges import overlap

FORMAT_NAME = "zeroshard-checkpoint"
FORMAT_VERSION = 1
TENSOR_PARALLEL_VERSION = 2  # split parameters saved as their pieces
READABLE_VERSIONS = (FORMAT_VERSION, TENSOR_PARALLEL_VERSION)

INDEX_FILE = "index.json"
# sha256 of index.json, written after it; the index cannot hold its own digest.
INDEX_DIGEST_FILE = "index.sha256"
LATEST_FILE = "latest"
EXTRAS_FILE = "module_extras.safetensors"
PYTHON_STATE_FILE = "python_state.pt"

MASTER_KIND = "master"

logger = logging.getLogger("zeroshard")


def state_kind(key: str) -> str:
    """The tensor-name prefix of an elementwise optimizer state."""
    return f"state.{key}"


def scalar_kind(key: str) -> str:
    """The tensor-name prefix of a 0-d optimizer state."""
    return f"scalar.{key}"


def tensor_name(kind: str, flat_id: str) -> str:
    return f"{kind}/{flat_id}"


def dtype_to_str(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def str_to_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"unknown dtype {name!r} in the checkpoint index")
    return dtype


# ------------------------------------------------------------------------------ files


def file_digest(path: Path) -> tuple[int, str]:
    """(size in bytes, sha256 hex) of a file, read in chunks."""
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
            size += len(chunk)
    return size, digest.hexdigest()


# ----------------------------------------------------------------------- tag folders


def tmp_tag_dir(save_dir: Path, tag: str) -> Path:
    """Where a save of `tag` is written before it is renamed into place."""
    return save_dir / f".{tag}.tmp"


def old_tag_dir(save_dir: Path, tag: str) -> Path:
    """Where the previous checkpoint of `tag` waits while a new one of that tag replaces it."""
    return save_dir / f".{tag}.old"


def validate_tag(tag: str) -> str:
    """`tag` if it is a plain directory name inside the save directory, else a CheckpointError."""
    tag = str(tag)
    if (
        not tag
        or tag.startswith(".")
        or tag != tag.strip()
        or any(c in tag for c in "/\\\0")
        or not tag.isprintable()
    ):
        raise CheckpointError(
            f"checkpoint tag {tag!r}: must be a plain directory name (no path separators, no leading "
            "'.', no leading or trailing whitespace, no control characters), e.g. 'global_step100'."
        )
    return tag


def read_latest(save_dir: Path) -> str | None:
    """The tag named by `save_dir/latest`, or None when there is no such file.

    Raises:
        CheckpointError: `latest` is empty, not UTF-8, or names no plain tag (an absolute
            path or '..' would read a checkpoint outside `save_dir`).
    """
    path = save_dir / LATEST_FILE
    if not path.is_file():
        return None
    tag = read_utf8(path).strip()
    if not tag:
        raise CheckpointError(f"{path}: empty; it should name the last complete checkpoint tag.")
    try:
        return validate_tag(tag)
    except CheckpointError as error:
        raise CheckpointError(f"{path}: {error}") from None


def find_tag_dir(save_dir: Path, tag: str) -> Path:
    """The directory of a complete checkpoint `tag`.

    A save that replaced an existing tag and died between its two renames leaves the
    previous complete checkpoint at `.<tag>.old`; it is used when `<tag>` itself is gone.

    Raises:
        CheckpointError: neither exists (names the path looked for).
    """
    final = save_dir / tag
    if (final / INDEX_FILE).is_file():
        return final
    old = old_tag_dir(save_dir, tag)
    if not final.exists() and (old / INDEX_FILE).is_file():
        return old
    if final.is_dir():
        raise CheckpointError(f"{final / INDEX_FILE}: missing; {final} is not a complete checkpoint.")
    raise CheckpointError(f"{final}: no checkpoint with tag {tag!r} in {save_dir}.")


def resolve_checkpoint_dir(ckpt_dir: str | os.PathLike, tag: str | None = None) -> Path:
    """A tag directory from either a save directory (+ tag, or its `latest`) or a tag directory.

    The tag, given or read from `latest`, must be a plain name (validate_tag): a `latest`
    holding an absolute path or '..' never makes this read another checkpoint.
    """
    path = Path(ckpt_dir)
    if tag is None and (path / INDEX_FILE).is_file():
        return path
    if tag is None:
        tag = read_latest(path)
        if tag is None:
            raise CheckpointError(
                f"{path}: neither a checkpoint (no {INDEX_FILE}) nor a save directory with a "
                f"'{LATEST_FILE}' file; pass the tag explicitly."
            )
    return find_tag_dir(path, validate_tag(tag))


# ---------------------------------------------------------------------------- index


def read_utf8(path: Path) -> str:
    """A text file of the checkpoint; bytes that are not UTF-8 are a CheckpointError naming it."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise CheckpointError(f"{path}: not UTF-8 text (byte {error.start}); the file is corrupt.") from None


def read_index_digest(tag_dir: Path) -> str | None:
    """The sha256 `index.sha256` records for index.json, or None when the file is absent."""
    path = tag_dir / INDEX_DIGEST_FILE
    if not path.is_file():
        return None
    text = read_utf8(path).split()
    if not text or len(text[0]) != 64 or any(c not in "0123456789abcdef" for c in text[0]):
        raise CheckpointError(f"{path}: corrupt; it should hold the sha256 of {INDEX_FILE}.")
    return text[0]


def index_digest_text(index_bytes: bytes) -> str:
    """The content of index.sha256 (the format `sha256sum -c` reads)."""
    return f"{hashlib.sha256(index_bytes).hexdigest()}  {INDEX_FILE}\n"


def load_index(tag_dir: Path) -> dict[str, Any]:
    """Parse and check `tag_dir/index.json` against its recorded digest and its own geometry.

    Raises:
        CheckpointError: missing, digest mismatch, not UTF-8, not JSON, another format or
            version, or a fragment that cannot be right (validate.check_index_geometry).
    """
    path = tag_dir / INDEX_FILE
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing; {tag_dir} is not a complete checkpoint.") from None
    expected = read_index_digest(tag_dir)
    if expected is not None and hashlib.sha256(data).hexdigest() != expected:
        raise CheckpointError(
            f"{path}: corrupt: its sha256 differs from the one in {tag_dir / INDEX_DIGEST_FILE}."
        )
    try:
        index = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as error:
        raise CheckpointError(f"{path}: not UTF-8 text (byte {error.start}); the index is corrupt.") from None
    except json.JSONDecodeError as error:
        raise CheckpointError(f"{path}: corrupt JSON ({error}).") from None
    except RecursionError:
        raise CheckpointError(f"{path}: JSON nested too deeply to be a checkpoint index.") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT_NAME:
        raise CheckpointError(f"{path}: not a zeroshard checkpoint index.")
    if index.get("version") not in READABLE_VERSIONS:
        raise CheckpointError(
            f"{path}: format version {index.get('version')}, this zeroshard reads versions "
            f"{', '.join(map(str, READABLE_VERSIONS))}."
        )
    if expected is None:
        if index.get("index_digest") is not None:
            raise CheckpointError(
                f"{tag_dir / INDEX_DIGEST_FILE}: missing; {path} says it was saved with one."
            )
        logger.warning(
            "%s: no %s (a checkpoint saved before zeroshard recorded the index digest); loading it "
            "without checking the index against accidental corruption.", path, INDEX_DIGEST_FILE
        )
    check_index_geometry(index, path)
    return index


# --------------------------------------------------------------------------- reading


class CheckpointReader:
    """Reads parameter ranges of one checkpoint, whatever layout saved them.

    Files are opened lazily; each is checked against the size and sha256 the index
    recorded the first time it is opened, so a truncated or altered file is an error that
    names it, never silently wrong numbers.
    """

    def __init__(self, tag_dir: Path, index: dict[str, Any] | None = None) -> None:
        self.tag_dir = Path(tag_dir)
        self.index = index if index is not None else load_index(self.tag_dir)
        self._open: dict[str, Any] = {}

    def close(self) -> None:
        self._open.clear()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- files
    def verify_file(self, file_name: str) -> Path:
        """Check a file's presence, size and checksum against the index."""
        path = self.tag_dir / file_name
        expected = self.index.get("files", {}).get(file_name)
        if expected is None:
            raise CheckpointError(f"{path}: not listed in {INDEX_FILE}; the index is corrupt.")
        if not path.is_file():
            raise CheckpointError(f"{path}: missing (the checkpoint lists it).")
        size, sha = file_digest(path)
        if size != expected["size"]:
            raise CheckpointError(f"{path}: corrupt: {size} bytes, the index recorded {expected['size']} (truncated?).")
        if sha != expected["sha256"]:
            raise CheckpointError(f"{path}: corrupt: its sha256 differs from the one in {INDEX_FILE}.")
        return path

    def open(self, file_name: str) -> None:
        """Open (and so check: size, checksum, rank metadata, lengths) `file_name` now."""
        self._handle(file_name)

    def _handle(self, file_name: str):
        handle = self._open.get(file_name)
        if handle is None:
            path = self.verify_file(file_name)
            try:
                handle = safe_open(str(path), framework="pt", device="cpu")
            except Exception as error:  # safetensors raises its own error types
                raise CheckpointError(f"{path}: unreadable safetensors file ({error}).") from None
            if file_name.startswith("rank_"):
                self._check_rank_metadata(file_name, path, handle)
                self._check_tensor_lengths(path, handle)
            self._open[file_name] = handle
        return handle

    def _check_rank_metadata(self, file_name: str, path: Path, handle: Any) -> None:
        """The file says it was written by the rank its name gives, in a run of this world size
        (rank files swapped and re-registered in the index would otherwise load shuffled)."""
        metadata = handle.metadata() or {}
        expected = {"rank": str(int(file_name[len("rank_") : -len(".safetensors")])),
                    "world_size": str(self.index["world_size"])}
        for key, value in expected.items():
            if metadata.get(key) != value:
                raise CheckpointError(
                    f"{path}: field metadata {key} = {metadata.get(key)!r}, expected {value!r} for this file "
                    f"of {INDEX_FILE}; the file belongs to another rank or checkpoint."
                )

    def _check_tensor_lengths(self, path: Path, handle: Any) -> None:
        """Every sharded tensor of a rank file has the length the index gives its flat buffer."""
        lengths = flat_lengths(self.index, self.tag_dir / INDEX_FILE)
        for key in handle.keys():
            kind, _, flat = key.rpartition("/")
            if flat not in lengths or not (kind == MASTER_KIND or kind.startswith("state.")):
                continue
            shape = handle.get_slice(key).get_shape()
            if list(shape) != [lengths[flat]]:
                raise CheckpointError(
                    f"{path}: tensor {key!r} has shape {list(shape)}, the index gives {flat} "
                    f"{lengths[flat]} elements per rank; the file does not belong to this index."
                )

    def _get(self, file_name: str, key: str, start: int | None = None, stop: int | None = None) -> torch.Tensor:
        handle = self._handle(file_name)
        try:
            if start is None:
                return handle.get_tensor(key)
            return handle.get_slice(key)[start:stop]
        except Exception as error:
            raise CheckpointError(
                f"{self.tag_dir / file_name}: tensor {key!r} missing or unreadable ({error}); the "
                "file does not match the index."
            ) from None

    def rank_file_tensors(self, rank: int, prefix: str) -> dict[str, torch.Tensor]:
        """Every tensor of rank `rank`'s file whose name starts with `prefix` (e.g. RNG state)."""
        file_name = rank_file_name(rank)
        handle = self._handle(file_name)
        return {k: handle.get_tensor(k) for k in handle.keys() if k.startswith(prefix)}

    def rank_file_metadata(self, rank: int) -> dict[str, str]:
        return dict(self._handle(rank_file_name(rank)).metadata() or {})

    def extras(self) -> dict[str, torch.Tensor]:
        """Module buffers and frozen parameters (rank 0's extras file)."""
        handle = self._handle(EXTRAS_FILE)
        return {k: handle.get_tensor(k) for k in handle.keys()}

    def extra(self, name: str) -> torch.Tensor:
        """One module buffer or frozen parameter (read alone: a frozen base model can be large)."""
        return self._get(EXTRAS_FILE, name)

    # -- parameters
    def split_of(self, name: str, index: int = 0) -> TensorSplit | None:
        """How parameter `name` was cut for tensor parallelism (its piece `index`), or None."""
        entry = self.index["params"][name]
        if "tensor_parallel" not in entry:
            return None
        return TensorSplit.from_json(entry["tensor_parallel"], entry["shape"], index)

    def read_range(self, name: str, kind: str, start: int, length: int, tp_index: int | None = None) -> torch.Tensor:
        """Elements [start, start + length) of parameter `name`'s flattened `kind` tensor (of its
        piece `tp_index`, for a parameter saved as tensor-parallel pieces).

        Assembled from every fragment that overlaps the range, in the saved dtype.
        """
        entry = self.index["params"][name]
        if ("tensor_parallel" in entry) != (tp_index is not None):
            raise CheckpointError(
                f"{self.tag_dir / INDEX_FILE}: parameter {name} is " + ("" if "tensor_parallel" in entry else "not ")
                + "saved as tensor-parallel pieces; read it with read_full."
            )
        fragments = [f for f in entry["fragments"] if f.get("tp_index") == tp_index]
        pieces = []
        stop = start + length
        for frag in sorted(fragments, key=lambda f: f["offset"]):
            common = overlap(start, stop, frag["offset"], frag["offset"] + frag["numel"])
            if common is None:
                continue
            lo, hi = common
            begin = frag["start"] + lo - frag["offset"]
            piece = self._get(rank_file_name(frag["rank"]), tensor_name(kind, frag["tensor"]), begin, begin + hi - lo)
            if piece.numel() != hi - lo:
                raise CheckpointError(
                    f"{self.tag_dir / rank_file_name(frag['rank'])}: tensor "
                    f"{tensor_name(kind, frag['tensor'])!r} is shorter than the index says; corrupt."
                )
            pieces.append(piece.reshape(-1))
        if not pieces:
            return torch.empty(0, dtype=self.saved_dtype(name, kind))
        return torch.cat(pieces) if len(pieces) > 1 else pieces[0]

    def saved_dtype(self, name: str, kind: str) -> torch.dtype:
        """The dtype parameter `name`'s `kind` tensor was saved in."""
        entry = self.index["params"][name]
        if kind == MASTER_KIND:
            return str_to_dtype(entry["master_dtype"])
        return str_to_dtype(entry["optimizer_state"][kind.removeprefix("state.")])

    def read_piece(self, name: str, kind: str, tp_index: int) -> torch.Tensor:
        """Piece `tp_index` of a parameter saved as tensor-parallel pieces, in its local shape."""
        split = self.split_of(name, tp_index)
        numel = 1
        for dim in split.local_shape:
            numel *= dim
        return self.read_range(name, kind, 0, numel, tp_index).reshape(split.local_shape)

    def read_full(self, name: str, kind: str = MASTER_KIND) -> torch.Tensor:
        """The whole parameter, in its saved shape and dtype (its pieces assembled)."""
        entry = self.index["params"][name]
        split = self.split_of(name)
        if split is not None:
            return split.assemble([self.read_piece(name, kind, t) for t in range(split.parts)])
        numel = 1
        for dim in entry["shape"]:
            numel *= int(dim)
        return self.read_range(name, kind, 0, numel).reshape(entry["shape"])

    def read_for(self, name: str, kind: str, start: int, length: int, split: TensorSplit | None) -> torch.Tensor:
        """Elements [start, start + length) of the flattened tensor a rank holding `split` (its
        piece of parameter `name`; None: the whole parameter) needs, whatever the saved cut: the
        saved piece itself when the cuts agree, else cut from the assembled whole (one
        parameter in memory at a time)."""
        saved = self.split_of(name, 0)
        if split is None and saved is None:
            return self.read_range(name, kind, start, length)
        if split is not None and saved is not None and saved.with_index(split.index) == split:
            return self.read_range(name, kind, start, length, split.index)
        whole = self.read_full(name, kind)
        mine = whole if split is None else split.piece_of(whole)
        return mine.reshape(-1)[start : start + length].clone()

    def read_scalar(self, names: list[str], key: str) -> torch.Tensor | None:
        """A 0-d optimizer state (e.g. `step`) saved with any of the parameters `names`.

        Every flat buffer that held one of them stepped together, so any fragment's copy
        will do; one in a file this reader has already opened is preferred (no extra file
        to read and check). None when none of them has a fragment (all empty).
        """
        fragments = [f for name in names for f in self.index["params"][name]["fragments"]]  # any piece's
        if not fragments:
            return None
        opened = [f for f in fragments if rank_file_name(f["rank"]) in self._open]
        frag = (opened or fragments)[0]
        return self._get(rank_file_name(frag["rank"]), tensor_name(scalar_kind(key), frag["tensor"]))
