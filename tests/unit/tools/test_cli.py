"""`zeroshard explain` and the subcommand dispatch: exit codes, JSON output, messages."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from zeroshard.cli import main

CONFIGS = Path(__file__).resolve().parents[3] / "examples" / "configs"
AUTOCAST_BF16 = CONFIGS / "zero3_autocast_bf16.json"


def run_json(capsys, *argv):
    assert main(["explain", *map(str, argv), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def write(tmp_path, raw, name="ds.json"):
    path = tmp_path / name
    path.write_text(json.dumps(raw))
    return path


def _holds_auto(path: Path) -> bool:
    return '"auto"' in path.read_text()


@pytest.mark.parametrize("path", sorted(p for p in CONFIGS.glob("*.json") if not _holds_auto(p)), ids=lambda p: p.name)
def test_every_example_config_explains(capsys, path):
    data = run_json(capsys, path, "--world-size", 8)
    assert data["world_size"] == 8
    assert data["batch"]["train_batch_size"] == (
        data["batch"]["train_micro_batch_size_per_gpu"] * data["batch"]["gradient_accumulation_steps"] * 8
    )


def test_autocast_bf16_zero3_with_a_model_lists_groups(capsys):
    data = run_json(capsys, AUTOCAST_BF16, "--world-size", 8, "--model", "tiny")
    assert data["zero_stage"] == 3 and data["precision"]["mode"] == "torch_autocast"
    groups = data["precision"]["groups"]
    assert (groups["lower_precision_safe"]["reduce"], groups["lower_precision_safe"]["gather"]) == ("bf16", "bf16")
    assert (groups["other"]["reduce"], groups["other"]["gather"]) == ("fp32", "fp32")
    model = data["model"]
    safe, other = model["groups"]["lower_precision_safe"], model["groups"]["other"]
    assert "blocks.0.attn.c_attn.weight" in safe["params"]
    assert {"wte.weight", "wpe.weight", "ln_f.weight", "blocks.0.ln_1.weight"} <= set(other["params"])
    assert not any(".ln_" in name or name.startswith(("wte", "wpe")) for name in safe["params"])
    assert safe["num_params"] + other["num_params"] == model["num_params"]
    memory = data["memory"]["estimate"]
    assert memory["num_params"] == model["num_params"]
    assert memory["model_states"]["master_weights"] == 0


class _Net:
    """Source of a module:factory model for --model."""

    SOURCE = textwrap.dedent(
        """
        from torch import nn

        def make():
            return nn.Sequential(nn.Embedding(10, 4), nn.LayerNorm(4), nn.Linear(4, 6))
        """
    )


def test_module_factory_model_is_built_on_meta(capsys, tmp_path, monkeypatch):
    (tmp_path / "my_models.py").write_text(_Net.SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    data = run_json(capsys, AUTOCAST_BF16, "--world-size", 2, "--model", "my_models:make")
    groups = data["model"]["groups"]
    assert groups["lower_precision_safe"] == {"num_params": 30, "num_tensors": 2, "params": ["2.weight", "2.bias"]}
    assert groups["other"] == {"num_params": 48, "num_tensors": 3, "params": ["0.weight", "1.weight", "1.bias"]}
    assert data["memory"]["estimate"]["per_group"]["other"]["padded_num_params"] == 48


def test_without_a_model_memory_is_per_parameter(capsys, tmp_path):
    path = write(tmp_path, {"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "bf16"},
                            "zero_optimization": {"stage": 2}})
    data = run_json(capsys, path, "--world-size", 4)
    assert data["model"] is None and data["memory"]["estimate"] is None
    assert data["memory"]["bytes_per_param"] == {"all": {"replicated": 2, "sharded": 14}}
    data = run_json(capsys, path, "--world-size", 4, "--params", 1000)
    assert data["memory"]["estimate"]["model_state_bytes"] == 2 * 1000 + 14 * 1000 // 4


def test_defaults_and_no_effect_keys_are_listed(capsys, tmp_path):
    path = write(tmp_path, {"zero_optimization": {"stage": 1, "overlap_comm": True}, "memory_breakdown": True})
    data = run_json(capsys, path)
    assert "gradient_clipping" in data["defaults_applied"]
    assert data["no_effect_keys"] == ["zero_optimization.overlap_comm", "memory_breakdown"]
    assert main(["explain", str(path)]) == 0
    out = capsys.readouterr().out
    assert "accepted, no effect: zero_optimization.overlap_comm, memory_breakdown" in out
    assert "defaults applied:" in out and "Precision plan" in out


def test_table_output_with_a_model(capsys):
    assert main(["explain", str(AUTOCAST_BF16), "--world-size", "8", "--model", "tiny"]) == 0
    out = capsys.readouterr().out
    assert "lower_precision_safe" in out and "autocast(bf16)" in out
    assert "Per-rank memory estimate" in out


@pytest.mark.parametrize(
    "raw, needle",
    [
        ({"zero_optimization": {"stgae": 2}}, "zero_optimization.stgae: unknown key. Did you mean 'stage'?"),
        ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "bf16.enabled and fp16.enabled are both true"),
        ({"train_batch_size": "auto"}, 'train_batch_size="auto"'),
        ({"zero_optimization": {"offload_param": {"device": "cpu"}}},
         "zero_optimization.offload_param: offloading parameters needs ZeRO stage 3 (stage is 0)"),
        ({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1},
         "train_batch_size=10 != train_micro_batch_size_per_gpu (4)"),
        ({"bf16": {"enabled": True}, "torch_autocast": {"enabled": True, "dtype": "float16"}},
         'torch_autocast.dtype="float16": with bf16.enabled'),
        ({"torch_autocast": {"enabled": True, "lower_precision_safe_modules": ["torch.nn.Lineer"]}},
         'torch_autocast.lower_precision_safe_modules="torch.nn.Lineer": does not import'),
        ({"bf16": {"bf16_optimizer_states": True}}, "bf16.bf16_optimizer_states=true"),
    ],
)
def test_bad_config_exits_2_with_one_message_naming_the_key(capsys, tmp_path, raw, needle):
    path = write(tmp_path, raw)
    assert main(["explain", str(path), "--world-size", "2"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert needle in captured.err
    assert "Traceback" not in captured.err
    assert captured.err.startswith(f"zeroshard explain: {path}: ")


def test_bad_model_spec_and_missing_file_exit_2(capsys, tmp_path):
    assert main(["explain", str(AUTOCAST_BF16), "--model", "no-such-preset"]) == 2
    assert "--model no-such-preset: unknown preset" in capsys.readouterr().err
    assert main(["explain", str(AUTOCAST_BF16), "--model", "no_such_module_xyz:make"]) == 2
    assert "cannot import 'make' from 'no_such_module_xyz'" in capsys.readouterr().err
    assert main(["explain", str(tmp_path / "missing.json")]) == 2
    assert "cannot be read" in capsys.readouterr().err


def test_bad_arguments_exit_2():
    with pytest.raises(SystemExit) as info:
        main(["explain", str(AUTOCAST_BF16), "--world-size", "0"])
    assert info.value.code == 2
    with pytest.raises(SystemExit) as info:
        main([])
    assert info.value.code == 2


def test_demo_forwards_its_arguments(monkeypatch):
    import zeroshard.demo.cli as demo_cli

    seen = []
    monkeypatch.setattr(demo_cli, "main", lambda argv: seen.append(argv) or 7)
    assert main(["demo", "--steps", "3", "--help"]) == 7
    assert seen == [["--steps", "3", "--help"]]


def test_python_dash_m_entry_point(tmp_path):
    path = write(tmp_path, {"fp16": {"enabled": True}, "bf16": {"enabled": True}})
    result = subprocess.run(
        [sys.executable, "-m", "zeroshard", "explain", str(path)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2
    assert "bf16.enabled and fp16.enabled are both true: pick one precision." in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("path", sorted(p for p in CONFIGS.glob("*.json") if _holds_auto(p)), ids=lambda p: p.name)
def test_trainer_configs_with_auto_are_explained_as_placeholders(capsys, path):
    """A config written for the Hugging Face Trainer ("auto" values it fills in) is refused by
    explain with the reason and the way to run it, once (docs/hf-trainer.md)."""
    assert main(["explain", str(path), "--world-size", "8"]) == 2
    err = capsys.readouterr().err
    assert err.count('"auto" is a placeholder that the Hugging Face Trainer') == 1, err
    assert "zeroshard install-deepspeed-alias" in err


def test_checkpointing_and_preemption_are_explained(capsys, tmp_path):
    """What a save and a scheduler's signal do, as the config's checkpoint.writer.decoupled and
    preemption section say (docs/cluster.md)."""
    plain = run_json(capsys, write(tmp_path, {"train_micro_batch_size_per_gpu": 2}))
    assert plain["checkpointing"] == {"asynchronous": False, "tag_validation": "Warn", "preemption": None}
    raw = {"train_micro_batch_size_per_gpu": 2, "checkpoint": {"writer": {"decoupled": True}},
           "preemption": {"enabled": True, "signals": ["usr1", "SIGTERM"], "save_dir": "/ckpt/run1",
                          "exit_code": 99, "resume": True}}
    path = write(tmp_path, raw, "preempt.json")
    data = run_json(capsys, path)
    assert data["checkpointing"] == {
        "asynchronous": True, "tag_validation": "Warn",
        "preemption": {"signals": ["SIGUSR1", "SIGTERM"], "save_dir": "/ckpt/run1", "tag": None, "exit_code": 99,
                       "resume": True},
    }
    assert main(["explain", str(path)]) == 0
    out = capsys.readouterr().out
    assert "checkpoints: asynchronous (checkpoint.writer.decoupled)" in out
    assert "preemption: SIGUSR1, SIGTERM -> the ranks save to /ckpt/run1 (tag global_step<N>)" in out
    assert "then every rank exits 99" in out and "resume from the newest complete checkpoint in /ckpt/run1" in out
    raw["preemption"] = {"enabled": True}
    assert main(["explain", str(write(tmp_path, raw, "poll.json"))]) == 0
    out = capsys.readouterr().out
    assert "preemption: SIGTERM, SIGUSR1, SIGUSR2 -> engine.should_stop() turns true" in out
