"""What a checkpoint holds and how loading fails: exports, `latest`, options, errors.

Most tests run one engine in the test process (world size 1, no process group); the last
ones run on 2 ranks, where one rank's failure must stop every rank before anything loads.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import zeroshard
from tests.dist.checkpoint.test_checkpoint_helpers import (
    GLOBAL_BATCH,
    TinyLM,
    assert_snapshots_equal,
    assert_tensors_equal,
    make_engine,
    snapshot,
    train,
)
from zeroshard.checkpoint import CheckpointError, consolidate_fp32, write_fp32
from zeroshard.checkpoint import save as checkpoint_save
from zeroshard.cli import main as cli_main


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, dict]:
    """A stage-3 bf16 checkpoint after 2 steps, and the engine's state at the save."""
    ckpt = tmp_path_factory.mktemp("files") / "ckpt"
    engine = make_engine(3, "bf16", seed=0)
    train(engine, 0, 2)
    engine.save_checkpoint(str(ckpt), client_state={"epoch": 4, "note": (1, "tuple"), "t": torch.ones(2)})
    return ckpt, snapshot(engine)


def test_index_describes_every_parameter(saved) -> None:
    ckpt, _ = saved
    assert (ckpt / "latest").read_text().strip() == "global_step2"
    index = json.loads((ckpt / "global_step2" / "index.json").read_text())
    model = TinyLM()
    trainable = {n: list(p.shape) for n, p in model.named_parameters() if p.requires_grad}
    assert {n: e["shape"] for n, e in index["params"].items()} == trainable
    assert index["aliases"] == {"head.weight": "emb.weight"}
    assert list(index["frozen_params"]) == ["frozen_gain"]
    assert list(index["buffers"]) == ["logit_bias"]  # the non-persistent buffer is not state
    assert index["state_dict_keys"] == list(model.state_dict())
    for entry in index["params"].values():
        assert entry["master_dtype"] == "float32" and entry["param_dtype"] == "bfloat16"
        assert set(entry["optimizer_state"]) == {"exp_avg", "exp_avg_sq"}
        assert entry["optimizer_scalars"] == {"step": "tensor"}
    # global_samples: 2 steps of one train batch (GLOBAL_BATCH rows x 2 micro-steps) each.
    train_batch = GLOBAL_BATCH * 2
    assert index["counters"] == {"global_steps": 2, "micro_steps": 4, "gradient_accumulation_steps": 2,
                                 "skipped_steps": 0, "global_samples": 2 * train_batch}
    assert index["config"]["zero_optimization"]["stage"] == 3
    assert index["precision_plan"]["mode"] == "bf16"
    # client_state with a tuple and a tensor is not plain JSON: it went to the pickle file.
    assert index["client_state"] == {"file": "python_state.pt"}


def test_consolidated_fp32_loads_strictly_into_a_plain_model(saved, tmp_path) -> None:
    ckpt, at_save = saved
    state = consolidate_fp32(ckpt)
    model = TinyLM()
    model.load_state_dict(state, strict=True)
    assert torch.equal(state["head.weight"], state["emb.weight"])
    assert state["head.weight"].data_ptr() != state["emb.weight"].data_ptr()  # safetensors-safe
    assert all(v.dtype == torch.float32 for v in state.values())
    assert_tensors_equal(at_save["params"], {n: state[n] for n in at_save["params"]}, "fp32 export")
    # The engine keeps frozen parameters in the parameter dtype (bf16 here): that is what exists.
    assert torch.equal(state["frozen_gain"], torch.linspace(0.9, 1.1, 8).to(torch.bfloat16).float())

    out = write_fp32(ckpt, tmp_path / "model.safetensors", tag="global_step2")
    from_file = load_file(str(out))
    assert set(from_file) == set(state)  # safetensors stores names sorted, not in model order
    assert_tensors_equal(state, from_file, "to-fp32 file")


def test_to_fp32_command(saved, tmp_path, capsys) -> None:
    ckpt, at_save = saved
    out = tmp_path / "consolidated.safetensors"
    assert cli_main(["to-fp32", str(ckpt), str(out)]) == 0
    state = load_file(str(out))
    model = TinyLM()
    model.load_state_dict(state, strict=True)
    assert torch.equal(model.head.weight, model.emb.weight)
    assert_tensors_equal(at_save["params"], {n: state[n] for n in at_save["params"]}, "to-fp32")
    assert cli_main(["to-fp32", str(ckpt), str(tmp_path / "x.safetensors"), "--tag", "nope"]) == 1
    assert "no checkpoint with tag 'nope'" in capsys.readouterr().err


def test_save_16bit_model_is_the_module_in_parameter_dtype(tmp_path) -> None:
    engine = make_engine(3, "bf16", seed=0)
    train(engine, 0, 1)
    path = engine.save_16bit_model(str(tmp_path))
    state = load_file(path)
    assert Path(path) == tmp_path / "pytorch_model.safetensors"
    assert set(state) == set(TinyLM().state_dict())
    assert state["emb.weight"].dtype == torch.bfloat16
    assert torch.equal(state["emb.weight"], state["head.weight"])
    masters = snapshot(engine)["params"]
    for name, master in masters.items():
        assert torch.equal(state[name], master.to(torch.bfloat16)), name
    TinyLM().load_state_dict(state, strict=True)


def test_resume_restores_client_state_scheduler_and_counters(saved) -> None:
    ckpt, at_save = saved
    engine = make_engine(3, "bf16", seed=1)
    path, client_state = engine.load_checkpoint(str(ckpt))
    assert path == str(ckpt / "global_step2")
    assert client_state["epoch"] == 4 and client_state["note"] == (1, "tuple")
    assert torch.equal(client_state["t"], torch.ones(2))
    assert engine.lr_scheduler.state_dict() == {"last_batch_iteration": 1}
    assert_snapshots_equal(at_save, snapshot(engine), "loaded")


def test_nothing_to_load_returns_none(tmp_path) -> None:
    engine = make_engine(0, "fp32")
    assert engine.load_checkpoint(str(tmp_path / "empty")) == (None, None)
    with pytest.raises(CheckpointError, match="no checkpoint with tag 'nope'"):
        engine.load_checkpoint(str(tmp_path), tag="nope")


def test_load_options(saved) -> None:
    ckpt, at_save = saved
    weights_only = make_engine(1, "bf16", seed=1)
    weights_only.load_checkpoint(str(ckpt), load_module_only=True)
    state = snapshot(weights_only)
    assert_tensors_equal(at_save["params"], state["params"], "module only")
    assert state["optimizer"] == {} and state["counters"] == (0, 0, 0)

    no_optimizer = make_engine(2, "bf16", seed=1)
    no_optimizer.load_checkpoint(str(ckpt), load_optimizer_states=False)
    state = snapshot(no_optimizer)
    assert_tensors_equal(at_save["params"], state["params"], "no optimizer state")
    assert state["optimizer"] == {}
    assert state["counters"] == at_save["counters"] and state["lr"] == at_save["lr"]


def test_load_into_another_precision_mode(saved) -> None:
    """bf16 (fp32 masters) saved, loaded as fp32 and as bf16 masters with fp32 moments."""
    ckpt, at_save = saved
    fp32 = make_engine(2, "fp32", seed=1)
    fp32.load_checkpoint(str(ckpt))
    assert_tensors_equal(at_save["params"], snapshot(fp32)["params"], "fp32 masters")
    assert_tensors_equal(at_save["optimizer"], snapshot(fp32)["optimizer"], "fp32 moments")

    low = make_engine(1, "bf16_master_fp32_state", seed=1)
    low.load_checkpoint(str(ckpt))
    state = snapshot(low)
    for name, master in at_save["params"].items():
        assert torch.equal(state["params"][name], master.to(torch.bfloat16).float()), name
        assert torch.equal(state["module"][name], master.to(torch.bfloat16)), name
    assert_tensors_equal(at_save["optimizer"], state["optimizer"], "moments kept in fp32")
    train(low, 2, 3)  # and it trains on


def test_sampler_epoch_is_restored(tmp_path) -> None:
    data = torch.utils.data.TensorDataset(torch.arange(24).reshape(12, 2))
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    torch.manual_seed(0)
    engine, _, loader, _ = zeroshard.initialize(model=torch.nn.Linear(2, 1), config=config, training_data=data)
    loader.sampler.set_epoch(3)
    engine.save_checkpoint(str(tmp_path))
    fresh, _, fresh_loader, _ = zeroshard.initialize(model=torch.nn.Linear(2, 1), config=config, training_data=data)
    fresh.load_checkpoint(str(tmp_path))
    assert fresh_loader.sampler.epoch == 3
    assert list(fresh_loader.sampler) == list(loader.sampler)


def test_tags_latest_and_replacing_a_tag(tmp_path, monkeypatch) -> None:
    engine = make_engine(1, "fp32")
    train(engine, 0, 1)
    engine.save_checkpoint(str(tmp_path), tag="keep")
    engine.save_checkpoint(str(tmp_path), tag="side", save_latest=False)
    assert (tmp_path / "latest").read_text().strip() == "keep"
    with pytest.raises(ValueError, match="plain directory name"):
        engine.save_checkpoint(str(tmp_path), tag="../escape")

    # Replacing "keep" and dying between moving the old copy aside and moving the new one in:
    # the old copy is still what "keep" loads.
    expected = snapshot(engine)
    train(engine, 1, 2)
    real_rename, calls = os.rename, []

    def dying_rename(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise KeyboardInterrupt("killed between the renames")
        real_rename(src, dst)

    monkeypatch.setattr(checkpoint_save.os, "rename", dying_rename)
    with pytest.raises(KeyboardInterrupt):
        engine.save_checkpoint(str(tmp_path), tag="keep")
    monkeypatch.undo()
    assert not (tmp_path / "keep").exists() and (tmp_path / ".keep.old").is_dir()
    fresh = make_engine(1, "fp32", seed=1)
    assert fresh.load_checkpoint(str(tmp_path))[0] == str(tmp_path / ".keep.old")
    assert_snapshots_equal(expected, snapshot(fresh), "recovered .old")

    engine.save_checkpoint(str(tmp_path), tag="keep")  # completes, clears the leftovers
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep", "latest", "side"]


# ------------------------------------------------------------------- failing loads


def _mismatched_model() -> torch.nn.Module:
    model = TinyLM()
    model.blocks[1].lin = torch.nn.Linear(8, 8, bias=False)  # a parameter less
    model.blocks[2].norm = torch.nn.LayerNorm(4)  # other shapes
    model.extra = torch.nn.Parameter(torch.zeros(3))
    return model


def test_model_mismatch_lists_every_difference_and_loads_nothing(saved) -> None:
    ckpt, _ = saved
    torch.manual_seed(1)
    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW"}, "bf16": {"enabled": True}}
    engine, *_ = zeroshard.initialize(model=_mismatched_model(), config=config)
    before = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    with pytest.raises(CheckpointError) as info:
        engine.load_checkpoint(str(ckpt))
    message = str(info.value)
    assert "does not match the model" in message
    assert "missing from the checkpoint: extra" in message
    assert "the model lacks: blocks.1.lin.bias" in message
    assert "blocks.2.norm.weight: shape [8] in the checkpoint, [4] in the model" in message
    after = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    assert_tensors_equal(before, after, "after a refused load")


@pytest.mark.parametrize("damage", ["corrupt_shard", "missing_extras", "corrupt_index"])
def test_damaged_checkpoint_is_named_and_nothing_is_loaded(saved, tmp_path, damage: str) -> None:
    ckpt, _ = saved
    copy = tmp_path / "copy"
    shutil.copytree(ckpt, copy)
    tag_dir = copy / "global_step2"
    if damage == "corrupt_shard":
        path = tag_dir / "rank_00000.safetensors"
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x01
        path.write_bytes(bytes(data))
        match = r"rank_00000\.safetensors: corrupt"
    elif damage == "missing_extras":
        (tag_dir / "module_extras.safetensors").unlink()
        match = r"module_extras\.safetensors: missing"
    else:
        (tag_dir / "index.json").write_text("{not json")
        match = r"index\.json: corrupt: its sha256 differs from the one in .*index\.sha256"
    engine = make_engine(3, "bf16", seed=1)
    train(engine, 0, 1)
    before = snapshot(engine)
    with pytest.raises(CheckpointError, match=match):
        engine.load_checkpoint(str(copy))
    assert_snapshots_equal(before, snapshot(engine), f"after a failed load ({damage})")


def load_with_rank1_file_missing(ckpt_dir: str) -> dict:
    engine = make_engine(1, "bf16", seed=1)
    train(engine, 0, 1)
    before = snapshot(engine)
    try:
        engine.load_checkpoint(ckpt_dir)
    except CheckpointError as error:
        message = str(error)
    else:
        message = None
    assert_snapshots_equal(before, snapshot(engine), "after a load that failed on rank 1")
    return {"message": message}


def save_on_two(ckpt_dir: str) -> None:
    engine = make_engine(1, "bf16", seed=0)
    train(engine, 0, 2)
    engine.save_checkpoint(ckpt_dir)


def test_one_rank_failing_stops_every_rank(dist_pool, tmp_path) -> None:
    ckpt = str(tmp_path / "ckpt")
    pool = dist_pool(2)
    pool.run(save_on_two, ckpt)
    (tmp_path / "ckpt" / "global_step2" / "rank_00001.safetensors").unlink()  # only rank 1 reads it
    results = pool.run(load_with_rank1_file_missing, ckpt)
    assert "rank_00001.safetensors: missing" in results[1]["message"]
    assert "failed on rank(s) [1]" in results[0]["message"]
    assert "rank_00001.safetensors: missing" in results[0]["message"]
