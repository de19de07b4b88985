"""A checkpoint directory is input, not code: crafted or damaged checkpoints are refused.

Each test copies a real checkpoint, edits it as an attacker (who also recomputes every
checksum the checkpoint records) or a damaged disk would, and asserts that loading raises a
CheckpointError naming the file and field, runs nothing, and leaves the engine bitwise
unchanged. One engine in the test process (world size 1); multi-rank cases are in
test_checkpoint_tags.py.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from tests.dist.checkpoint.test_checkpoint_helpers import assert_snapshots_equal, make_engine, snapshot, train
from tests.dist.checkpoint_craft import register_file, rewrite_index, rewrite_rank_file
from zeroshard.checkpoint import CheckpointError

TAG = "global_step2"


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, dict]:
    """A stage-2 fp32 checkpoint after 2 steps with plain-JSON client state, and its snapshot."""
    ckpt = tmp_path_factory.mktemp("trust") / "ckpt"
    engine = make_engine(2, "fp32", seed=0)
    train(engine, 0, 2)
    engine.save_checkpoint(str(ckpt), client_state={"epoch": 4})
    return ckpt, snapshot(engine)


@pytest.fixture
def copy(saved, tmp_path) -> Path:
    """A private copy of the saved checkpoint directory, free to damage."""
    out = tmp_path / "copy"
    shutil.copytree(saved[0], out)
    return out


@pytest.fixture(scope="module")
def victim() -> tuple:
    """A trained engine that the failing loads must leave as it is, and its snapshot."""
    engine = make_engine(2, "fp32", seed=1)
    train(engine, 0, 1)
    return engine, snapshot(engine)


def _refused(victim, ckpt: Path, match: str, **kwargs) -> CheckpointError:
    """Loading `ckpt` raises a CheckpointError matching `match`; the engine (masters, optimizer
    state, module, buffers, loss scale, counters, lr) and the RNG state are bitwise unchanged."""
    engine, before = victim
    rng_before = torch.get_rng_state()
    with pytest.raises(CheckpointError, match=match) as info:
        engine.load_checkpoint(str(ckpt), **kwargs)
    assert_snapshots_equal(before, snapshot(engine), "after a refused load")
    assert torch.equal(rng_before, torch.get_rng_state()), "the RNG state changed"
    return info.value


# ----------------------------------------------------------------- code execution


class _RunsCode:
    """Unpickling this calls os.system: it creates the marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _plant_pickle(tag_dir: Path, marker: Path) -> None:
    """What someone with write access to the directory can do to a JSON-only checkpoint."""
    torch.save({"client_state": {"x": _RunsCode(marker)}}, tag_dir / "python_state.pt")
    register_file(tag_dir, "python_state.pt")
    rewrite_index(tag_dir, lambda index: index.update(client_state={"file": "python_state.pt"}))


def test_crafted_pickle_is_refused_and_never_run(copy, victim, tmp_path) -> None:
    marker = tmp_path / "code_ran"
    _plant_pickle(copy / TAG, marker)
    error = _refused(victim, copy, r"python_state\.pt: holds Python objects")
    assert "allow_pickle=True" in str(error)
    assert not marker.exists(), "loading the checkpoint ran code from python_state.pt"


def test_module_only_load_never_reads_client_state(copy, saved, tmp_path) -> None:
    marker = tmp_path / "code_ran"
    _plant_pickle(copy / TAG, marker)
    engine = make_engine(2, "fp32", seed=1)
    path, client_state = engine.load_checkpoint(str(copy), load_module_only=True)
    assert not marker.exists(), "a module-only load read python_state.pt"
    assert path == str(copy / TAG) and client_state == {}
    torch.testing.assert_close(snapshot(engine)["params"], saved[1]["params"], rtol=0, atol=0)


def test_allow_pickle_is_the_explicit_opt_in(copy, tmp_path) -> None:
    marker = tmp_path / "code_ran"
    _plant_pickle(copy / TAG, marker)
    engine = make_engine(2, "fp32", seed=1)
    engine.load_checkpoint(str(copy), allow_pickle=True)
    assert marker.exists()  # the documented consequence of allow_pickle=True


def test_plain_python_state_loads_without_allow_pickle(tmp_path) -> None:
    """Tuples, tensors, sets and int keys are not JSON but are plain data: no opt-in needed."""
    engine = make_engine(2, "fp32", seed=0)
    train(engine, 0, 1)
    client = {"t": torch.arange(3.0), "pair": (1, "a"), "ids": {1, 2}, 7: [0.5, None]}
    engine.save_checkpoint(str(tmp_path), client_state=client)
    fresh = make_engine(2, "fp32", seed=1)
    _, loaded = fresh.load_checkpoint(str(tmp_path))
    assert loaded.keys() == client.keys()
    assert torch.equal(loaded["t"], client["t"])
    assert loaded["pair"] == (1, "a") and loaded["ids"] == {1, 2} and loaded[7] == [0.5, None]


# --------------------------------------------------------------- the index itself


def _first_fragment(index: dict) -> dict:
    """The fragment at element 0 of flat0's slice."""
    return next(e["fragments"][0] for e in index["params"].values() if e["fragments"][0]["start"] == 0)


@pytest.mark.parametrize("how", ["latest", "tag"])
def test_edited_fragment_start_is_refused(copy, victim, how: str) -> None:
    """The issue's reproduction: a fragment's start moved from 0 to 1 loaded "OK", shifted."""
    rewrite_index(copy / TAG, lambda index: _first_fragment(index).update(start=1))
    kwargs = {"tag": TAG} if how == "tag" else {}
    _refused(victim, copy, r"index\.json: params\.[\w.]+\.fragments: leave elements \[0, 1\)", **kwargs)


@pytest.mark.parametrize("how", ["latest", "tag"])
def test_accidentally_changed_index_is_named(copy, victim, how: str) -> None:
    """One changed digit without a new digest: the recorded sha256 no longer matches."""
    path = copy / TAG / "index.json"
    text = path.read_text()
    path.write_text(text.replace('"global_steps": 2', '"global_steps": 3'))
    kwargs = {"tag": TAG} if how == "tag" else {}
    _refused(victim, copy, r"index\.json: corrupt: its sha256 differs from the one in .*index\.sha256", **kwargs)


# ------------------------------------------------------------- half-loads (item 6)


def _set(path: list, value):
    def edit(index: dict) -> None:
        node = index
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value

    return edit


BAD_FIELDS = {
    "global_steps_null": (_set(["counters", "global_steps"], None), r"field counters\.global_steps = None"),
    "global_steps_7x": (_set(["counters", "global_steps"], "7x"), r"field counters\.global_steps = '7x'"),
    "micro_steps_negative": (_set(["counters", "micro_steps"], -4), r"field counters\.micro_steps = -4"),
    "skipped_steps_bool": (_set(["counters", "skipped_steps"], True), r"field counters\.skipped_steps = True"),
    "sampler_epoch": (_set(["data_sampler"], {"epoch": "3"}), r"field data_sampler\.epoch = '3'"),
    "scaler_kind": (_set(["loss_scaler"], {"kind": 5}), r"field loss_scaler = \{'kind': 5\}"),
    "scheduler_state": (
        _set(["lr_scheduler"], {"json": {"last_batch_iteration": "1"}}),
        r"field lr_scheduler\.last_batch_iteration = '1'",
    ),
    "scheduler_not_a_table": (_set(["lr_scheduler"], {"json": [1]}), r"field lr_scheduler = \[1\]"),
    "lr_string": (
        _set(["optimizer", "param_groups", 0, "hyper", "lr"], "0.1"),
        r"field optimizer\.param_groups\[0\]\.hyper\.lr = '0\.1'",
    ),
}


@pytest.mark.parametrize("bad", sorted(BAD_FIELDS))
def test_bad_field_is_named_and_nothing_is_written(copy, victim, bad: str) -> None:
    edit, match = BAD_FIELDS[bad]
    rewrite_index(copy / TAG, edit)
    _refused(victim, copy, r"index\.json: " + match)


def _python_rng(metadata: dict) -> None:
    metadata["rng.python"] = "[3, [1, 2], null]"


def _torch_rng(tensors: dict) -> None:
    tensors["rng/torch_cpu"] = tensors["rng/torch_cpu"][:100].clone()


def _step_as_vector(tensors: dict) -> None:
    tensors["scalar.step/flat0"] = torch.ones(3)


@pytest.mark.parametrize("bad", ["python", "torch", "step"])
def test_bad_rank_file_state_is_named_and_nothing_is_written(copy, victim, bad: str) -> None:
    if bad == "python":
        rewrite_rank_file(copy / TAG, 0, metadata_edit=_python_rng)
        match = r"rank_00000\.safetensors: field metadata rng\.python = '\[3, \[1, 2\], null\]'"
    elif bad == "torch":
        rewrite_rank_file(copy / TAG, 0, tensors_edit=_torch_rng)
        match = r"rank_00000\.safetensors: field rng/torch_cpu = 'torch\.uint8 \[100\]'"
    else:
        rewrite_rank_file(copy / TAG, 0, tensors_edit=_step_as_vector)
        match = r"field optimizer scalar step = \[3\]: must hold one element"
    _refused(victim, copy, match)


def test_extras_file_that_disagrees_with_the_model_is_refused(copy, victim) -> None:
    from safetensors.torch import load_file, save_file

    path = copy / TAG / "module_extras.safetensors"
    extras = load_file(str(path))
    extras["logit_bias"] = torch.zeros(3)
    save_file(extras, str(path))
    register_file(copy / TAG, "module_extras.safetensors")
    _refused(victim, copy, r"module_extras\.safetensors: tensor 'logit_bias' has shape \[3\]")


# ------------------------------------------------- fault injection on a 2-rank checkpoint


def save_on_two_ranks(ckpt_dir: str) -> None:
    engine = make_engine(1, "fp32", seed=0)
    train(engine, 0, 2)
    engine.save_checkpoint(ckpt_dir)


@pytest.fixture(scope="module")
def two_rank_ckpt(dist_pool, tmp_path_factory) -> Path:
    """A checkpoint written by 2 ranks; the single-process victim reads both rank files."""
    ckpt = tmp_path_factory.mktemp("two") / "ckpt"
    dist_pool(2).run(save_on_two_ranks, str(ckpt), timeout=300)
    return ckpt


def _truncate(tag_dir: Path, name: str) -> None:
    path = tag_dir / name
    path.write_bytes(path.read_bytes()[:-100])


def _swap(tag_dir: Path) -> None:
    a, b = tag_dir / "rank_00000.safetensors", tag_dir / "rank_00001.safetensors"
    a.rename(tag_dir / "swap")
    b.rename(a)
    (tag_dir / "swap").rename(b)


def _swap_and_register(tag_dir: Path) -> None:
    _swap(tag_dir)
    register_file(tag_dir, "rank_00000.safetensors")
    register_file(tag_dir, "rank_00001.safetensors")


def _truncate_and_register(tag_dir: Path) -> None:
    _truncate(tag_dir, "rank_00001.safetensors")
    register_file(tag_dir, "rank_00001.safetensors")


def _shift_offsets(tag_dir: Path) -> None:
    def edit(index: dict) -> None:
        for entry in index["params"].values():
            if len(entry["fragments"]) == 2:
                entry["fragments"][1]["offset"] -= 1
                entry["fragments"][1]["numel"] += 1
                return

    rewrite_index(tag_dir, edit)


FAULTS = {
    "truncated_shard": (
        lambda d: _truncate(d, "rank_00001.safetensors"), r"rank_00001\.safetensors: corrupt: .*truncated"
    ),
    "truncated_shard_registered": (_truncate_and_register, r"rank_00001\.safetensors: unreadable safetensors"),
    "truncated_index": (lambda d: _truncate(d, "index.json"), r"index\.json: corrupt: its sha256 differs"),
    "edited_offsets": (_shift_offsets, r"index\.json: params\.[\w.]+\.fragments"),
    "swapped_rank_files": (_swap, r"rank_0000[01]\.safetensors: corrupt: its sha256 differs"),
    "swapped_rank_files_registered": (_swap_and_register, r"rank_00000\.safetensors: field metadata rank = '1'"),
    "missing_shard": (lambda d: (d / "rank_00001.safetensors").unlink(), r"rank_00001\.safetensors: missing"),
    "missing_extras": (lambda d: (d / "module_extras.safetensors").unlink(), r"module_extras\.safetensors: missing"),
    "missing_digest": (lambda d: (d / "index.sha256").unlink(), r"index\.sha256: missing"),
    "missing_index": (lambda d: (d / "index.json").unlink(), r"index\.json: missing"),
}


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_fault_is_named_and_nothing_is_loaded(two_rank_ckpt, victim, tmp_path, fault: str) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(two_rank_ckpt, copy)
    damage, match = FAULTS[fault]
    damage(copy / TAG)
    _refused(victim, copy, match)
