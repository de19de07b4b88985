"""The checkpoint format without an engine: fragment index, reading ranges, checks, RNG, tags."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from zeroshard.checkpoint.format import (
    FORMAT_NAME,
    FORMAT_VERSION,
    INDEX_DIGEST_FILE,
    INDEX_FILE,
    CheckpointError,
    CheckpointReader,
    file_digest,
    find_tag_dir,
    index_digest_text,
    load_index,
    rank_file_name,
    resolve_checkpoint_dir,
    validate_tag,
)
from zeroshard.checkpoint.rng import apply_rng_state, capture_rng_state, parse_rng_state
from zeroshard.checkpoint.save import json_roundtrips

# A parameter "w" of shape (2, 5) split over two ranks: rank 0 holds elements 0..5 at
# position 2 of its flat0 slice (behind 2 elements of another parameter "b"), rank 1 holds
# elements 6..9 at position 0 of its slice.
W = torch.arange(10, dtype=torch.float32).reshape(2, 5) / 7
B = torch.tensor([-1.0, -2.0])


def _write_checkpoint(tag_dir: Path) -> dict:
    tag_dir.mkdir(parents=True)
    flat = W.reshape(-1)
    save_file(
        {"master/flat0": torch.cat([B, flat[:6]]), "state.exp_avg/flat0": torch.ones(8)},
        str(tag_dir / rank_file_name(0)),
        metadata={"rank": "0", "world_size": "2"},
    )
    save_file(
        {"master/flat0": torch.cat([flat[6:], torch.zeros(4)]), "state.exp_avg/flat0": torch.ones(8)},
        str(tag_dir / rank_file_name(1)),
        metadata={"rank": "1", "world_size": "2"},
    )
    files = {}
    for rank in (0, 1):
        size, sha = file_digest(tag_dir / rank_file_name(rank))
        files[rank_file_name(rank)] = {"size": size, "sha256": sha}
    common = {"master_dtype": "float32", "optimizer_state": {"exp_avg": "float32"}, "optimizer_scalars": {}}
    index = {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "world_size": 2,
        "files": files,
        "flats": [{"id": "flat0", "shard_numel": 8}],
        "params": {
            "b": {
                "shape": [2],
                **common,
                "fragments": [{"rank": 0, "offset": 0, "numel": 2, "tensor": "flat0", "start": 0}],
            },
            "w": {
                "shape": [2, 5],
                **common,
                "fragments": [
                    {"rank": 0, "offset": 0, "numel": 6, "tensor": "flat0", "start": 2},
                    {"rank": 1, "offset": 6, "numel": 4, "tensor": "flat0", "start": 0},
                ],
            },
        },
    }
    (tag_dir / INDEX_FILE).write_text(json.dumps(index))
    return index


def test_reader_assembles_ranges_across_rank_files(tmp_path: Path) -> None:
    _write_checkpoint(tmp_path / "t")
    with CheckpointReader(tmp_path / "t") as reader:
        assert torch.equal(reader.read_full("w"), W)
        assert torch.equal(reader.read_full("b"), B)
        # A range that straddles the two ranks' fragments.
        assert torch.equal(reader.read_range("w", "master", 4, 5), W.reshape(-1)[4:9])
        assert torch.equal(reader.read_range("w", "state.exp_avg", 5, 2), torch.ones(2))
        assert reader.read_range("w", "master", 3, 0).numel() == 0


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_damaged_shard_file_is_named(tmp_path: Path, damage: str) -> None:
    _write_checkpoint(tmp_path / "t")
    path = tmp_path / "t" / rank_file_name(1)
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[-3] ^= 0xFF
        path.write_bytes(bytes(data))
    elif damage == "truncate":
        path.write_bytes(bytes(data[:-5]))
    else:
        path.unlink()
    expected = {"flip": "sha256 differs", "truncate": "truncated", "delete": "missing"}[damage]
    with CheckpointReader(tmp_path / "t") as reader:
        reader.read_range("w", "master", 0, 6)  # rank 0's file alone is fine
        with pytest.raises(CheckpointError, match=rf"rank_00001\.safetensors: .*{expected}"):
            reader.read_full("w")


def test_corrupt_or_foreign_index(tmp_path: Path) -> None:
    _write_checkpoint(tmp_path / "t")
    index_path = tmp_path / "t" / INDEX_FILE
    index_path.write_text('{"format": "zeroshard-checkpoint", "version": 1, "par')
    with pytest.raises(CheckpointError, match=r"index\.json: corrupt JSON"):
        load_index(tmp_path / "t")
    index_path.write_text(json.dumps({"format": FORMAT_NAME, "version": 99, "params": {}}))
    with pytest.raises(CheckpointError, match="format version 99"):
        load_index(tmp_path / "t")
    index_path.unlink()
    with pytest.raises(CheckpointError, match="index.json: missing"):
        load_index(tmp_path / "t")


def test_tag_directory_resolution(tmp_path: Path) -> None:
    _write_checkpoint(tmp_path / "a")
    (tmp_path / "latest").write_text("a\n")
    assert resolve_checkpoint_dir(tmp_path) == tmp_path / "a"
    assert resolve_checkpoint_dir(tmp_path / "a") == tmp_path / "a"
    assert resolve_checkpoint_dir(tmp_path, "a") == tmp_path / "a"
    with pytest.raises(CheckpointError, match="no checkpoint with tag 'b'"):
        find_tag_dir(tmp_path, "b")
    # A replacement of "a" that died between its two renames: the old copy is used.
    (tmp_path / "a").rename(tmp_path / ".a.old")
    assert find_tag_dir(tmp_path, "a") == tmp_path / ".a.old"
    with pytest.raises(CheckpointError, match="latest"):
        resolve_checkpoint_dir(tmp_path / "nothing-here")


@pytest.mark.parametrize("tag", ["", ".", "..", ".hidden", "a/b", "a\\b", " a", "a ", "a\n", "a\tb", "/abs"])
def test_bad_tags_are_refused(tag: str) -> None:
    with pytest.raises(ValueError, match="plain directory name"):
        validate_tag(tag)


def test_rng_state_roundtrip() -> None:
    tensors, metadata = capture_rng_state()
    first = (torch.rand(3), random.random(), np.random.rand(2))
    torch.manual_seed(5)
    random.seed(5)
    np.random.seed(5)
    apply_rng_state(parse_rng_state(tensors, metadata, "RNG state"))
    again = (torch.rand(3), random.random(), np.random.rand(2))
    assert torch.equal(first[0], again[0])
    assert first[1] == again[1]
    assert np.array_equal(first[2], again[2])


def test_json_roundtrip_detects_lossy_values() -> None:
    assert json_roundtrips({"lr": 0.1 + 0.2, "steps": 3, "name": "x", "ok": None})
    assert not json_roundtrips({"betas": (0.9, 0.999)})  # would come back as a list
    assert not json_roundtrips({1: "int key"})  # would come back as "1"
    assert not json_roundtrips({"t": torch.ones(1)})


def _edit_fragment(index: dict, name: str, i: int, **fields) -> None:
    index["params"][name]["fragments"][i].update(fields)


GEOMETRY_EDITS = {
    # edit(index) -> the field and the rule the error must name
    "start_shifted_into_padding": (
        lambda ix: _edit_fragment(ix, "w", 1, start=1), r"params\.w\.fragments: leave elements \[0, 1\) of flat0"
    ),
    "start_overlaps_other_param": (
        lambda ix: _edit_fragment(ix, "w", 0, start=1), r"params\.w\.fragments: overlap b's elements of flat0"
    ),
    "start_past_tensor_end": (
        lambda ix: _edit_fragment(ix, "w", 1, start=5), r"params\.w\.fragments\[1\]\.start: \[5, 9\) lies outside"
    ),
    "offset_outside_param": (
        lambda ix: _edit_fragment(ix, "w", 1, offset=7), r"params\.w\.fragments\[1\]: elements \[7, 11\) lie outside"
    ),
    "gap_in_param": (lambda ix: _edit_fragment(ix, "w", 1, numel=3), r"params\.w\.fragments: cover 9 of"),
    "overlap_in_param": (
        lambda ix: _edit_fragment(ix, "w", 1, offset=5, numel=5), r"params\.w\.fragments: do not tile"
    ),
    "unknown_rank": (
        lambda ix: _edit_fragment(ix, "w", 1, rank=2), r"params\.w\.fragments\[1\]\.rank: 2 is not a rank"
    ),
    "string_start": (lambda ix: _edit_fragment(ix, "w", 0, start="2"), r"params\.w\.fragments\[0\]: .* integer"),
    "unknown_tensor": (lambda ix: _edit_fragment(ix, "b", 0, tensor="flat9"), r"params\.b\.fragments\[0\]"),
    "bad_shape": (lambda ix: ix["params"]["w"].update(shape=[2, -5]), r"params\.w\.shape"),
}


@pytest.mark.parametrize("edit", sorted(GEOMETRY_EDITS))
def test_every_fragment_is_checked_against_the_index(tmp_path: Path, edit: str) -> None:
    """An edited index (its digest recomputed, as an attacker would) is refused, naming the field."""
    index = _write_checkpoint(tmp_path / "t")
    change, match = GEOMETRY_EDITS[edit]
    change(index)
    (tmp_path / "t" / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"index\.json: " + match):
        load_index(tmp_path / "t")


def test_rank_file_tensor_of_another_length_is_refused(tmp_path: Path) -> None:
    """A rank file whose tensors do not have the per-rank length the index gives (a file of
    another save, its checksum recorded by whoever swapped it in)."""
    index = _write_checkpoint(tmp_path / "t")
    path = tmp_path / "t" / rank_file_name(1)
    tensors = {"master/flat0": torch.zeros(9), "state.exp_avg/flat0": torch.ones(9)}
    save_file(tensors, str(path), metadata={"rank": "1", "world_size": "2"})
    size, sha = file_digest(path)
    index["files"][rank_file_name(1)] = {"size": size, "sha256": sha}
    (tmp_path / "t" / INDEX_FILE).write_text(json.dumps(index))
    with CheckpointReader(tmp_path / "t") as reader, pytest.raises(
        CheckpointError, match=r"rank_00001\.safetensors: tensor 'master/flat0' has shape \[9\]"
    ):
        reader.read_full("w")


def test_index_digest_is_checked(tmp_path: Path) -> None:
    index = _write_checkpoint(tmp_path / "t")
    index_path = tmp_path / "t" / INDEX_FILE
    (tmp_path / "t" / INDEX_DIGEST_FILE).write_text(index_digest_text(index_path.read_bytes()))
    assert load_index(tmp_path / "t") == index
    index_path.write_bytes(index_path.read_bytes().replace(b'"start": 2', b'"start": 3'))  # a flipped digit
    with pytest.raises(CheckpointError, match=r"index\.json: corrupt: its sha256 differs from .*index\.sha256"):
        load_index(tmp_path / "t")
    # An index that says it has a digest file, without it.
    index["index_digest"] = INDEX_DIGEST_FILE
    index_path.write_text(json.dumps(index))
    (tmp_path / "t" / INDEX_DIGEST_FILE).unlink()
    with pytest.raises(CheckpointError, match=r"index\.sha256: missing"):
        load_index(tmp_path / "t")


def test_index_without_digest_still_loads_with_a_warning(tmp_path: Path, caplog) -> None:
    """Checkpoints saved before the digest existed stay loadable."""
    index = _write_checkpoint(tmp_path / "t")
    with caplog.at_level("WARNING", logger="zeroshard"):
        assert load_index(tmp_path / "t") == index
    assert "no index.sha256" in caplog.text


def test_index_that_is_not_utf8_or_nested_too_deeply(tmp_path: Path) -> None:
    _write_checkpoint(tmp_path / "t")
    index_path = tmp_path / "t" / INDEX_FILE
    index_path.write_bytes(b'{"format": "\xff\xfe"}')
    with pytest.raises(CheckpointError, match=r"index\.json: not UTF-8 text \(byte 12\)"):
        load_index(tmp_path / "t")
    index_path.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(CheckpointError, match=r"index\.json: JSON nested too deeply"):
        load_index(tmp_path / "t")


@pytest.mark.parametrize("latest", ["OTHER", "../other/a", "a/../../other/a"])
def test_latest_cannot_point_outside_the_save_directory(tmp_path: Path, latest: str) -> None:
    """`latest` (or --tag) holding an absolute path or '..' must not read another checkpoint."""
    _write_checkpoint(tmp_path / "other" / "a")
    save_dir = tmp_path / "save"
    save_dir.mkdir()
    latest = str(tmp_path / "other" / "a") if latest == "OTHER" else latest
    (save_dir / "latest").write_text(latest + "\n")
    with pytest.raises(CheckpointError, match=r"save/latest: checkpoint tag .*plain directory name"):
        resolve_checkpoint_dir(save_dir)
    with pytest.raises(CheckpointError, match=r"checkpoint tag .*plain directory name"):
        resolve_checkpoint_dir(save_dir, latest)


def test_latest_that_is_not_utf8(tmp_path: Path) -> None:
    (tmp_path / "latest").write_bytes(b"global_step\xff")
    with pytest.raises(CheckpointError, match=r"latest: not UTF-8 text"):
        resolve_checkpoint_dir(tmp_path)
