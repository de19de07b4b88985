"""Checks of a checkpoint index's geometry, before any tensor is read through it.

The index says where every parameter's elements are: fragments `(rank, offset, numel,
tensor, start)`. A wrong number there reads the wrong elements silently (a `start` moved by
one shifts a parameter by one element and still "loads"), so every fragment is checked
against everything the index itself knows:

- its fields are integers of the right sign, its rank is one of the saving run's ranks and
  that rank's file is listed;
- it lies inside its parameter (`offset + numel <= numel(shape)`) and inside its tensor in
  the rank file (`start + numel <= shard_numel` of that flat buffer);
- the fragments of a parameter cover it exactly (no gap, no overlap); for a parameter saved as
  tensor-parallel pieces, the fragments of each piece (`tp_index`) cover that piece;
- the fragments in one rank file tensor follow each other from element 0, with no overlap
  and no gap: a rank's slice of a flat buffer holds its parameters back to back (padding
  comes only after the last), so a fragment moved inside the tensor is caught too.

The reader then checks, when it opens a rank file, that each tensor really has the length
the index gives its flat buffer (format.CheckpointReader).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from zeroshard.checkpoint.base import CheckpointError, rank_file_name


def is_int(value: Any) -> bool:
    """An int that is not a bool (JSON true would pass isinstance(value, int))."""
    return isinstance(value, int) and not isinstance(value, bool)


def _fail(path: Path, field: str, rule: str) -> CheckpointError:
    return CheckpointError(f"{path}: {field}: {rule}; the index is corrupt or was edited.")


def flat_lengths(index: dict[str, Any], path: Path) -> dict[str, int]:
    """Flat buffer id -> the number of elements each rank file holds of it."""
    flats = index.get("flats")
    if not isinstance(flats, list):
        raise _fail(path, "flats", f"{type(flats).__name__} instead of a list of flat buffers")
    lengths: dict[str, int] = {}
    for k, flat in enumerate(flats):
        if not isinstance(flat, dict) or not isinstance(flat.get("id"), str) or not is_int(flat.get("shard_numel")):
            raise _fail(path, f"flats[{k}]", "needs a string 'id' and an integer 'shard_numel'")
        if flat["shard_numel"] < 0 or flat["id"] in lengths:
            raise _fail(path, f"flats[{k}]", "negative shard_numel or a repeated id")
        lengths[flat["id"]] = flat["shard_numel"]
    return lengths


def _numel(shape: Any, path: Path, field: str) -> int:
    if not isinstance(shape, list) or not all(is_int(d) and d >= 0 for d in shape):
        raise _fail(path, field, f"{shape!r} is not a list of non-negative integers")
    numel = 1
    for dim in shape:
        numel *= dim
    return numel


def _check_fragment(frag: Any, field: str, numel: int, world: int, lengths: dict[str, int], files, path) -> None:
    keys = ("rank", "offset", "numel", "start")
    if not isinstance(frag, dict) or not all(is_int(frag.get(k)) for k in keys) or frag.get("tensor") not in lengths:
        raise _fail(path, field, f"{frag!r} needs integer {', '.join(keys)} and a 'tensor' listed in 'flats'")
    if not 0 <= frag["rank"] < world:
        raise _fail(path, f"{field}.rank", f"{frag['rank']} is not a rank of the saving run (world size {world})")
    if rank_file_name(frag["rank"]) not in files:
        raise _fail(path, f"{field}.rank", f"{rank_file_name(frag['rank'])} is not listed in 'files'")
    if frag["offset"] < 0 or frag["numel"] <= 0 or frag["start"] < 0:
        raise _fail(path, field, "offset and start must be >= 0 and numel > 0")
    if frag["offset"] + frag["numel"] > numel:
        raise _fail(path, field, f"elements [{frag['offset']}, {frag['offset'] + frag['numel']}) lie outside "
                    f"the parameter's {numel}")
    length = lengths[frag["tensor"]]
    if frag["start"] + frag["numel"] > length:
        raise _fail(path, f"{field}.start", f"[{frag['start']}, {frag['start'] + frag['numel']}) lies outside the "
                    f"{length} elements of {frag['tensor']} in {rank_file_name(frag['rank'])}")


def check_index_geometry(index: dict[str, Any], path: Path) -> None:
    """Raise a CheckpointError naming the field of the first fragment that cannot be right.

    Args:
        index: the parsed index.json.
        path: its path, for the messages.
    """
    world = index.get("world_size")
    if not is_int(world) or world < 1:
        raise _fail(path, "world_size", f"{world!r} is not a positive integer")
    files = index.get("files")
    if not isinstance(files, dict):
        raise _fail(path, "files", "not a table of file names")
    for name, entry in files.items():
        if not isinstance(entry, dict) or not is_int(entry.get("size")) or not isinstance(entry.get("sha256"), str):
            raise _fail(path, f"files.{name}", "needs an integer 'size' and a string 'sha256'")
    lengths = flat_lengths(index, path)
    params = index.get("params")
    if not isinstance(params, dict):
        raise _fail(path, "params", "not a table of parameters")
    # (rank, tensor) -> [(start, stop, parameter)], to find fragments that share file elements.
    placed: dict[tuple[int, str], list[tuple[int, int, str]]] = {}
    for name, entry in params.items():
        field = f"params.{name}"
        if not isinstance(entry, dict) or not isinstance(entry.get("fragments"), list):
            raise _fail(path, field, "needs a 'shape' and a list of 'fragments'")
        numel = _numel(entry.get("shape"), path, f"{field}.shape")
        parts = _parts(entry, numel, path, field)
        numel //= parts  # of each piece
        fragments = entry["fragments"]
        for i, frag in enumerate(fragments):
            _check_fragment(frag, f"{field}.fragments[{i}]", numel, world, lengths, files, path)
            index = frag.get("tp_index")
            if (parts > 1 or "tensor_parallel" in entry) != (index is not None) or (
                index is not None and not (is_int(index) and 0 <= index < parts)
            ):
                raise _fail(path, f"{field}.fragments[{i}].tp_index", f"{index!r} does not name one of the "
                            f"{parts} tensor-parallel pieces the parameter was saved as")
        for index in sorted({f.get("tp_index") for f in fragments}, key=lambda t: -1 if t is None else t) or [None]:
            covered = 0
            for frag in sorted((f for f in fragments if f.get("tp_index") == index), key=lambda f: f["offset"]):
                if frag["offset"] != covered:
                    raise _fail(path, f"{field}.fragments", f"do not tile the parameter (a gap or an overlap at "
                                f"element {min(covered, frag['offset'])})")
                covered += frag["numel"]
                placed.setdefault((frag["rank"], frag["tensor"]), []).append(
                    (frag["start"], frag["start"] + frag["numel"], name)
                )
            if covered != numel:
                raise _fail(path, f"{field}.fragments", f"cover {covered} of the parameter's {numel} elements")
        pieces = {f.get("tp_index") for f in fragments}
        if "tensor_parallel" in entry and numel and pieces != set(range(parts)):
            raise _fail(path, f"{field}.fragments", f"hold pieces {sorted(pieces)} of the {parts} it was cut into")
    for (rank, tensor), spans in placed.items():
        _check_packed(sorted(spans), rank, tensor, path)


def _parts(entry: dict[str, Any], numel: int, path: Path, field: str) -> int:
    """How many tensor-parallel pieces the parameter was saved as (1: whole), checked against its
    shape: the pieces are equal (zeroshard/autotp/split.py)."""
    split = entry.get("tensor_parallel")
    if split is None:
        return 1
    shape = entry["shape"]
    ok = (
        isinstance(split, dict) and is_int(split.get("parts")) and split["parts"] >= 1 and is_int(split.get("dim"))
        and 0 <= split["dim"] < len(shape) and shape[split["dim"]] % split["parts"] == 0
    )
    if not ok:
        raise _fail(path, f"{field}.tensor_parallel", f"{split!r} does not cut shape {shape} into equal pieces")
    return split["parts"]


def _check_packed(spans: list[tuple[int, int, str]], rank: int, tensor: str, path: Path) -> None:
    """A rank's slice of a flat buffer holds its parameters back to back from element 0
    (padding only after the last), so its fragments must follow each other exactly."""
    where = f"{tensor} in {rank_file_name(rank)}"
    position, previous = 0, None
    for start, stop, name in spans:
        if start < position:
            raise _fail(path, f"params.{name}.fragments", f"overlap {previous}'s elements of {where} "
                        f"(from element {start})")
        if start > position:
            raise _fail(path, f"params.{name}.fragments", f"leave elements [{position}, {start}) of {where} "
                        "unaccounted for (a rank's slice holds its parameters back to back)")
        position, previous = stop, name
