"""The Hugging Face Trainer trains on zeroshard unchanged (issue 24): `TrainingArguments(deepspeed=...)`
under torchrun, 2 CPU processes, with the `deepspeed` alias installed.

One launch runs every configuration (tests/dist/scenarios/hf_trainer.py); the tests below read
what it wrote. The references are independent of zeroshard: the same Trainer run without
DeepSpeed (DDP), the uninterrupted run for resumption, and the weights gathered parameter by
parameter for `save_model`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from zeroshard.tools.deepspeed_alias import install

ROOT = Path(__file__).resolve().parents[3]
SCENARIO = ROOT / "tests" / "dist" / "scenarios" / "hf_trainer.py"

# fp32: DDP all-reduces bucketed gradients, stage 2-3 reduce-scatter flat shards, so the sums run
# in another order; the losses (about 4.17, float32 spacing 4.8e-7 there) may differ in the last
# bits. Measured: at most 4.8e-7 (one spacing). Four spacings allow for another summation order.
FP32_ATOL = 2e-6
# bf16: the arithmetic differs by design (DDP: fp32 weights under Accelerate's bf16 autocast, so
# the residual stream and norms stay fp32; zeroshard: bf16 weights and activations, fp32 masters),
# so the losses agree only to bf16 rounding averaged over the batch's 64 tokens. Measured: at most
# 6.8e-5 (1.6e-5 relative); 5e-4 leaves room for other machines' kernels and is still 40 times
# smaller than the loss's movement over these 4 steps (0.02).
BF16_ATOL = 5e-4


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    work = tmp_path_factory.mktemp("hf_trainer")
    alias = work / "alias"
    install(target=alias)
    out = work / "out.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(alias), str(ROOT)]))
    env.pop("CUDA_VISIBLE_DEVICES", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(SCENARIO), str(out), str(work / "runs")]
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_losses_equal_the_trainer_without_deepspeed(runs: dict, stage: int, precision: str) -> None:
    losses = runs["rank0"]["losses"]
    reference, got = dict(losses[f"ddp_{precision}"]), dict(losses[f"stage{stage}_{precision}"])
    # the reference really is the Trainer without DeepSpeed, and the run really is zeroshard's
    assert (reference.pop("wrapper"), got.pop("wrapper")) == ("DistributedDataParallel", "Engine")
    assert list(got) == ["1", "2", "3", "4", "eval"] == list(reference)
    tolerance = FP32_ATOL if precision == "fp32" else BF16_ATOL
    for step, value in got.items():
        assert abs(value - reference[step]) <= tolerance, (step, value, reference[step])


@pytest.mark.parametrize("stage", [1, 3])
def test_resume_from_checkpoint_continues_the_same_run(runs: dict, stage: int) -> None:
    run = runs["rank0"]["resume"][f"stage{stage}"]
    # The Trainer finds DeepSpeed's layout: a global_step* directory and `latest` inside checkpoint-2.
    assert "global_step2" in run["checkpoint_files"] and "latest" in run["checkpoint_files"]
    # Resumed at step 2 (steps 1-2 come from trainer_state.json): steps 3-4 retrained, bitwise
    # equal to the uninterrupted run (same arithmetic, CPU is deterministic).
    assert run["resumed"] == run["whole"]
    assert run["global_steps"] == 4
    # deepspeed.utils.zero_to_fp32.load_state_dict_from_zero_checkpoint(model, "checkpoint-4") gives
    # the engine's final weights exactly (fp32: the masters are the weights)
    assert run["fp32_from_checkpoint"] == 0.0


def test_save_model_at_stage3_loads_exactly(runs: dict) -> None:
    saved = runs["rank0"]["save_model"]
    assert "model.safetensors" in saved["files"], saved["files"]
    assert saved["missing"] == []
    assert saved["nonzero"], "the gathered weights are empty: the comparison below would be vacuous"
    assert max(saved["loaded_vs_gathered"].values()) == 0.0, saved["loaded_vs_gathered"]
    assert max(saved["consolidated_vs_gathered"].values()) == 0.0
    assert runs["rank1"]["save_model"]["consolidated_on_other_rank"], "DeepSpeed returns None off rank 0"
    # The Trainer counts stage-3 parameters by ds_numel (trainer_pt_utils.get_model_param_count).
    assert saved["param_count"] == saved["plain_param_count"]


def test_evaluate_before_training_is_zero_inference(runs: dict) -> None:
    # trainer.evaluate() with no training at stage 3: deepspeed_init(inference=True), an engine
    # without optimizer; the plain model's evaluation is the reference (same weights, fp32).
    other = runs["rank0"]["other"]
    assert other["inference_wrapper"] == "Engine"
    assert other["inference_eval_loss"] == other["plain_eval_loss"]


def test_save_model_without_gathering_writes_a_checkpoint(runs: dict) -> None:
    # stage3_gather_16bit_weights_on_model_save unset: Accelerate refuses the state dict and the
    # Trainer writes a DeepSpeed checkpoint instead of weights, as with DeepSpeed.
    files = runs["rank0"]["other"]["nogather_files"]
    assert "latest" in files and any(f.startswith("global_step") for f in files), files
    assert "model.safetensors" not in files


def test_load_best_model_at_end_restores_the_best_checkpoint(runs: dict) -> None:
    other = runs["rank0"]["other"]
    # step 2 evaluated better than step 4, so the final weights are not the best ones
    assert other["best_checkpoint"].endswith("checkpoint-2"), other
    assert other["eval_history"]["4"] != other["best_metric"] == other["eval_history"]["2"]
    # evaluating the reloaded engine gives the best checkpoint's recorded loss: its weights are back
    assert other["eval_after_best"] == other["best_metric"]


def test_torch_compile_compiles_every_decoder_layer_with_the_same_losses(runs: dict) -> None:
    # TrainingArguments(torch_compile=True, torch_compile_backend="aot_eager"): Accelerate calls
    # engine.compile(backend, compile_kwargs), which compiles each decoder layer as one graph (both
    # layers share it); aot_eager runs the eager kernels, so the run is the stage-2 run, bit for bit.
    other = runs["rank0"]["other"]
    assert other["is_compiled"] is True
    assert other["compiled_regions"] == [["model.layers.0", True], ["model.layers.1", True]]
    assert other["compiled_graphs"] == 1
    eager = {k: v for k, v in runs["rank0"]["losses"]["stage2_fp32"].items() if k != "eval"}
    assert other["compiled_losses"] == eager


def test_offload_swaps_the_trainers_adamw_for_deepspeed_cpu_adam(runs: dict) -> None:
    # offload_optimizer and no optimizer section: the Trainer's torch AdamW becomes DeepSpeedCPUAdam
    # (accelerate's map_pytorch_optim_to_deepspeed), the same update as the DDP run's AdamW
    rank0 = runs["rank0"]
    run, want = rank0["other"]["offload_adamw_torch"], rank0["losses"]["ddp_fp32"]
    assert run["optimizer"] == "DeepSpeedCPUAdam" and run["losses"]["wrapper"] == "Engine"
    for step in "1234":  # another reduction order: FP32_ATOL
        assert abs(run["losses"][step] - want[step]) <= FP32_ATOL, (step, run["losses"][step], want[step])
