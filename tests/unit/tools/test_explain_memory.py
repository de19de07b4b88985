"""`zeroshard explain`'s memory plan: the flags, the JSON's stable keys, what they add up to, and
the refusals (the prediction's accuracy is checked against the allocator in tests/dist/memory)."""

import json

import pytest

from zeroshard.cli import main

PLAN_KEYS = {
    "device_peak_bytes", "host_peak_bytes", "reserved_bytes", "save_host_peak_bytes", "async_save_host_peak_bytes",
    "consolidate_fp32_host_peak_bytes", "consolidate_16bit_host_peak_bytes", "load_host_peak_bytes", "peak_phase",
    "parts", "host_parts", "phase_peaks", "activations", "micro_batch", "seq", "activation_checkpointing", "device",
    "traced", "assumptions",
}
TINY_LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128, "max_position_embeddings": 64}


def explain(capsys, tmp_path, raw, *argv):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(raw))
    assert main(["explain", str(path), *map(str, argv), "--json"]) == 0
    return json.loads(capsys.readouterr().out)["memory"]


def test_the_plan_of_a_preset_adds_up(capsys, tmp_path):
    raw = {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True}, "zero_optimization": {
        "stage": 2, "offload_optimizer": {"device": "cpu"}}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}
    memory = explain(capsys, tmp_path, raw, "--model", "tiny", "--world-size", 2, "--seq", 32)
    assert PLAN_KEYS <= set(memory) and memory["traced"] and memory["device"] == "cuda"
    assert (memory["micro_batch"], memory["seq"]) == (2, 32)
    # The device peak is its parts at that instant; the host holds the offloaded states.
    assert memory["device_peak_bytes"] == sum(memory["parts"].values())
    assert memory["peak_phase"] in ("forward", "backward", "step")
    states = memory["estimate"]["model_states"]
    assert memory["parts"]["params"] == states["params"]  # bf16 parameters, whole at stage 2
    assert memory["host_parts"]["master_weights"] == states["master_weights"]
    assert memory["host_peak_bytes"] >= states["master_weights"] + states["optimizer_state"]
    assert memory["reserved_bytes"] > memory["device_peak_bytes"]
    activations = memory["activations"]
    assert 0 < activations["with_checkpointing"] < activations["without_checkpointing"]
    checkpointed = explain(capsys, tmp_path, raw, "--model", "tiny", "--world-size", 2, "--seq", 32,
                           "--activation-checkpointing")
    assert checkpointed["activation_checkpointing"]
    assert checkpointed["device_peak_bytes"] <= memory["device_peak_bytes"]
    assert checkpointed["phase_peaks"]["forward"] < memory["phase_peaks"]["forward"]
    assert checkpointed["activations"] == activations  # both traced either way


def test_without_a_model_the_peak_is_states_and_bounds(capsys, tmp_path):
    raw = {"bf16": {"enabled": True}, "zero_optimization": {"stage": 3}}
    memory = explain(capsys, tmp_path, raw, "--params", 8_000_000, "--world-size", 8, "--device", "cpu")
    assert not memory["traced"] and memory["reserved_bytes"] is None and memory["activations"] == {}
    assert memory["device_peak_bytes"] == memory["estimate"]["total_bytes"]
    assert any("activations are not included" in a for a in memory["assumptions"])


def test_a_hugging_face_config_is_traced(capsys, tmp_path):
    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text(json.dumps(TINY_LLAMA))
    raw = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}, "bf16": {"enabled": True}}
    memory = explain(capsys, tmp_path, raw, "--hf-config", tmp_path / "llama", "--seq", 16)
    assert memory["traced"] and memory["parts"]["activations"] > 0 and memory["seq"] == 16
    assert memory["consolidate_16bit_host_peak_bytes"] > 0


@pytest.mark.parametrize("argv, message", [
    (["--model", "tiny", "--seq", 65], "--seq 65: the model takes at most 64 tokens"),
    (["--model", "tiny", "--params", 10], "not allowed with argument"),
    (["--hf-config", "no/such/config.json"], "--hf-config no/such/config.json: cannot read"),
])
def test_bad_arguments_exit_2_naming_them(capsys, tmp_path, argv, message):
    path = tmp_path / "ds.json"
    path.write_text("{}")
    with pytest.raises(SystemExit) if "not allowed" in message else _no_raise():
        code = main(["explain", str(path), *map(str, argv)])
        assert code == 2
    assert message in capsys.readouterr().err


class _no_raise:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_the_plan_says_it_does_not_replay_the_deterministic_reduction(capsys, tmp_path):
    """The deterministic reduction's buffers are not replayed (issue 43 on top of issue 39): the
    plan must say so rather than pass for that mode's peak; without the mode it says nothing."""
    raw = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}
    plain = explain(capsys, tmp_path, raw, "--model", "tiny", "--world-size", 2, "--seq", 16, "--device", "cpu")
    assert not any("deterministic" in a for a in plain["assumptions"])
    raw["zeroshard"] = {"deterministic_reduction": True}
    memory = explain(capsys, tmp_path, raw, "--model", "tiny", "--world-size", 2, "--seq", 16, "--device", "cpu")
    assert any("deterministic reduction" in a and "not replayed" in a for a in memory["assumptions"])
