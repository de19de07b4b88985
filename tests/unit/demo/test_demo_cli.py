"""`zeroshard demo` pieces that need no processes: the launch command, env, embedded config."""

import json
import os
import sys

import pytest

from zeroshard.demo.cli import build_parser, child_env, main, torchrun_command
from zeroshard.demo.train import RunDirMismatch, check_run_dir, default_config, parse_args
from zeroshard.resolve import resolve_config


def test_embedded_config_is_valid_and_fp32_on_cpu() -> None:
    config = resolve_config(default_config(total_steps=300, on_gpu=False), world_size=2)
    assert config.zero_optimization.stage == 2
    assert config.train_batch_size == 16 * 1 * 2
    assert config.optimizer.type == "AdamW"
    assert config.scheduler.type == "WarmupCosineLR"
    assert config.scheduler.params["total_num_steps"] == 300
    assert not config.bf16.enabled and not config.fp16.enabled
    assert config.gradient_clipping == 1.0


def test_embedded_config_is_bf16_on_gpu() -> None:
    config = resolve_config(default_config(total_steps=10, on_gpu=True), world_size=8)
    assert config.bf16.enabled
    # Warmup never exceeds the run: a 10-step run warms up for 1 step.
    assert config.scheduler.params["warmup_num_steps"] == 1


def test_torchrun_command_passes_every_flag(tmp_path) -> None:
    config_file = tmp_path / "ds.json"
    config_file.write_text("{}")
    args = build_parser().parse_args(["--steps", "7", "--model", "tiny", "--config", str(config_file)])
    command = torchrun_command(args, nproc=2, run_dir=tmp_path / "run")
    assert command[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert command[command.index("--nproc_per_node") + 1] == "2"
    script_args = command[command.index("zeroshard.demo.train") + 1 :]
    train_args = parse_args(script_args)
    assert train_args.steps == 7
    assert train_args.model == "tiny"
    assert train_args.run_dir == str(tmp_path / "run")
    assert train_args.config == str(config_file.resolve())


def test_child_env_shares_cpu_threads_and_finds_the_package(monkeypatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    env = child_env(nproc=2, on_gpu=False)
    cores = len(os.sched_getaffinity(0))
    assert env["OMP_NUM_THREADS"] == str(max(1, cores // 2))
    import zeroshard

    package_parent = os.path.dirname(os.path.dirname(os.path.abspath(zeroshard.__file__)))
    assert env["PYTHONPATH"].split(os.pathsep)[0] == package_parent
    # A user's own setting wins.
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert child_env(nproc=2, on_gpu=False)["OMP_NUM_THREADS"] == "3"


def test_run_dir_of_another_model_is_refused(tmp_path, capsys) -> None:
    check_run_dir(tmp_path, "small")  # no run yet: fine
    (tmp_path / "run.json").write_text(json.dumps({"model": "tiny"}))
    check_run_dir(tmp_path, "tiny")
    with pytest.raises(RunDirMismatch, match="holds a run of model 'tiny', not 'small'"):
        check_run_dir(tmp_path, "small")
    # The CLI says so before starting any process.
    assert main(["--run-dir", str(tmp_path), "--model", "small"]) == 2
    assert "pass --model tiny" in capsys.readouterr().err


def test_missing_config_file_is_refused(tmp_path, capsys) -> None:
    assert main(["--config", str(tmp_path / "nope.json"), "--run-dir", str(tmp_path)]) == 2
    assert "no such file" in capsys.readouterr().err


def test_bad_steps_is_refused() -> None:
    with pytest.raises(SystemExit):
        parse_args(["--steps", "0"])
