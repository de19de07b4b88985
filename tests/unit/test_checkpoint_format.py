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
    INDEX_FILE,
    CheckpointError,
    CheckpointReader,
    file_digest,
    find_tag_dir,
    load_index,
    rank_file_name,
    resolve_checkpoint_dir,
    validate_tag,
)
from zeroshard.checkpoint.rng import capture_rng_state, restore_rng_state
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
    )
    save_file(
        {"master/flat0": torch.cat([flat[6:], torch.zeros(4)]), "state.exp_avg/flat0": torch.ones(8)},
        str(tag_dir / rank_file_name(1)),
    )
    files = {}
    for rank in (0, 1):
        size, sha = file_digest(tag_dir / rank_file_name(rank))
        files[rank_file_name(rank)] = {"size": size, "sha256": sha}
    common = {"master_dtype": "float32", "optimizer_state": {"exp_avg": "float32"}, "optimizer_scalars": {}}
    index = {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "files": files,
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


def test_fragments_that_do_not_tile_are_a_corrupt_index(tmp_path: Path) -> None:
    index = _write_checkpoint(tmp_path / "t")
    index["params"]["w"]["fragments"][1]["offset"] = 7
    (tmp_path / "t" / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="fragments of parameter 'w' do not tile it"):
        load_index(tmp_path / "t")


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


@pytest.mark.parametrize("tag", ["", ".", "..", ".hidden", "a/b", "a\\b"])
def test_bad_tags_are_refused(tag: str) -> None:
    with pytest.raises(ValueError, match="plain directory name"):
        validate_tag(tag)


def test_rng_state_roundtrip() -> None:
    tensors, metadata = capture_rng_state()
    first = (torch.rand(3), random.random(), np.random.rand(2))
    torch.manual_seed(5)
    random.seed(5)
    np.random.seed(5)
    restore_rng_state(tensors, metadata)
    again = (torch.rand(3), random.random(), np.random.rand(2))
    assert torch.equal(first[0], again[0])
    assert first[1] == again[1]
    assert np.array_equal(first[2], again[2])


def test_json_roundtrip_detects_lossy_values() -> None:
    assert json_roundtrips({"lr": 0.1 + 0.2, "steps": 3, "name": "x", "ok": None})
    assert not json_roundtrips({"betas": (0.9, 0.999)})  # would come back as a list
    assert not json_roundtrips({1: "int key"})  # would come back as "1"
    assert not json_roundtrips({"t": torch.ones(1)})
