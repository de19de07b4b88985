"""`zeroshard simulate` in this process (zeroshard/tools/simulate.py): the report's keys, FSDP2 in
the same harness, several fabrics in one run, what a simulated rank refuses, and the command's
errors. The comparison with real ranks is tests/dist/tools/test_simulate_validation.py."""

from __future__ import annotations

import json

import pytest
import torch

import zeroshard
from zeroshard.cli import main
from zeroshard.comm import simulated
from zeroshard.comm.fabric import PRESETS
from zeroshard.models import build_model
from zeroshard.tools.simulate import SimulateOptions, simulate

W = 8
CONFIG = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
          "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
KEYS = {"simulated", "world_size", "rank", "model_states_bytes", "peak_device_allocated_bytes",
        "peak_device_reserved_bytes", "peak_host_bytes", "compute_step_s", "collectives", "exposed_comm_s", "fabric"}


@pytest.mark.parametrize("engine", ["zeroshard", "fsdp2"])
def test_report_and_fsdp2_in_the_same_harness(engine: str) -> None:
    report = simulate(SimulateOptions(CONFIG, W, W - 1, model="tiny", seq=16, steps=1, engine=engine,
                                      fabric=[PRESETS["nvlink"], PRESETS["ib"]]))
    assert KEYS <= set(report) and report["simulated"] is True and report["engine"] == engine
    assert not torch.distributed.is_initialized()  # the simulated group is gone
    # fp32 stage 3 with AdamW, every unit sharded: parameter, gradient and two moments per
    # element, 16 bytes x parameters / W for either engine (W divides every dimension of "tiny",
    # so neither pads).
    parameters = sum(p.numel() for p in build_model("tiny").parameters())
    assert report["parameters"] == parameters
    assert report["model_states_bytes"]["total"] == pytest.approx(16 * parameters / W, rel=0.01)
    assert [f["name"] for f in report["fabrics"]] == ["nvlink", "ib"]
    assert report["fabric"]["name"] == "nvlink" and report["exposed_comm_s"] == report["fabrics"][0]["exposed_comm_s"]
    # The slower fabric's modelled wire time is the larger: same collectives, 9x less bandwidth.
    assert report["fabrics"][1]["modelled_comm_s"] > report["fabrics"][0]["modelled_comm_s"] > 0
    kinds = {row["op"] for row in report["collectives"]}
    assert {"all_gather", "reduce_scatter"} <= kinds and {row["group_size"] for row in report["collectives"]} == {W}


def test_a_simulated_rank_writes_no_checkpoint(tmp_path) -> None:
    with simulated.world(2, rank=1):
        model = build_model("tiny")
        engine, *_ = zeroshard.initialize(model=model, config={**CONFIG, "zero_optimization": {"stage": 1}})
        with pytest.raises(simulated.SimulatedWorldError, match="save_checkpoint: this process is rank 1"):
            engine.save_checkpoint(tmp_path / "ckpt")
        with pytest.raises(simulated.SimulatedWorldError, match="save_16bit_model"):
            engine.save_16bit_model(tmp_path / "weights")
        engine.destroy()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--world-size", "8", "--rank", "8", "--model", "tiny"], "--rank 8: must be in [0, 8) for --world-size 8"),
        (["--world-size", "8", "--model", "gpt5"], "--model gpt5: unknown preset"),
        (["--world-size", "8", "--hf-config", "missing.json"], "--hf-config missing.json: no such file"),
        (["--world-size", "8", "--model", "tiny", "--fabric", "x=1"], "--fabric='x=1': not a preset"),
    ],
)
def test_command_errors_exit_2(tmp_path, monkeypatch, capsys, argv, message) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ds.json").write_text(json.dumps(CONFIG))
    assert main(["simulate", "ds.json", *argv]) == 2
    assert message in capsys.readouterr().err


def test_a_bad_config_names_the_key(tmp_path, capsys) -> None:
    (tmp_path / "ds.json").write_text(json.dumps({**CONFIG, "zero_optimization": {"stgae": 3}}))
    assert main(["simulate", str(tmp_path / "ds.json"), "--world-size", "8", "--model", "tiny"]) == 2
    assert "stgae" in capsys.readouterr().err
