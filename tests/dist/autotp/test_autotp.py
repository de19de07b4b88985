"""AutoTP under ZeRO on gloo, world 4 = tensor 2 x data 2 (tests/dist/scenarios/autotp.py):
tiny Hugging Face Llama (grouped-query attention: 4 heads, 2 key-value heads) in fp32 and Qwen3
(q_norm/k_norm summed over the tensor group) in bf16, stages 0-3, gradient accumulation 2,
against a single-process run of the unsplit model that does the same casts by hand; Llama fp32
with optimizer offload (stage 2) and parameter offload (stage 3) as well. One pool
run holds every world-4 case; a second (world 2) resumes the checkpoint at tensor 2 x data 1.
The other (model, precision) pairs and longer runs: benchmarks/autotp_conformance.py.

Tolerances, stated once:
- fp32 (FP32_TOL = 1e-5, absolute): the row-split layers sum two partial products over the
  tensor group where the reference computes one matmul, and the data ranks' gradients are
  averaged by a reduction; both reorder fp32 additions. Losses are ~4.2 (float32 spacing
  4.8e-7); what was measured is <= 4e-7 on the losses and norms and <= 3e-6 on the weights
  after 2-3 AdamW steps; a wrong split or a missing gradient sum is off by > 1e-2.
- bf16 (first step: BF16_FIRST = 2e-3 on the loss, 2% on the norm; later steps 1e-2): the
  row-split sums the partial products in bf16 (one more rounding, relative error up to 2^-8
  per element) where the reference rounds the whole product once. After an AdamW step the
  weights move by ~lr=1e-2 per element whatever the gradient's size, so a tiny gradient whose
  sign the rounding flipped moves a weight the other way: later losses are compared within
  1e-2, well below the step's own change of the loss.
"""

from __future__ import annotations

import os
from collections import Counter

import pytest

FP32_TOL = 1e-5
BF16_FIRST_LOSS = 2e-3
BF16_FIRST_NORM = 0.02
BF16_LATER = 1e-2
TIMEOUT_S = 600
CASES = [("llama", "fp32", stage, "") for stage in range(4)]
CASES += [("qwen3", "bf16", stage, "") for stage in range(4)]
CASES.append(("llama", "fp32", 2, "optimizer"))  # masters and AdamW state on the host
CASES.append(("llama", "fp32", 3, "param"))  # stage 3: the parameters' shards on the host too


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("autotp"))


@pytest.fixture(scope="module")
def world4(dist_pool, workdir):
    return dist_pool(4).run("tests.dist.scenarios.autotp:scenario", workdir, CASES, timeout=TIMEOUT_S)


@pytest.fixture(scope="module")
def world2(dist_pool, workdir, world4):  # world4 wrote the checkpoint
    return dist_pool(2).run("tests.dist.scenarios.autotp:world2", workdir, timeout=TIMEOUT_S)


def _close(got: list[float], want: list[float], tol: float) -> bool:
    return all(abs(a - b) <= tol for a, b in zip(got, want, strict=True))


@pytest.mark.parametrize("stage", range(4))
def test_llama_fp32_equals_the_unsplit_model(world4, stage):
    for rank, out in enumerate(world4):
        case = out["cases"][("llama", "fp32", stage, "")]
        ref = case["reference"]
        assert _close(case["losses"], ref["losses"], FP32_TOL), (rank, case["losses"], ref["losses"])
        assert _close(case["norms"], ref["norms"], FP32_TOL), (rank, case["norms"], ref["norms"])
        assert case["weight_error"] <= FP32_TOL, (rank, case["weight_error"])
        assert len(set(case["losses"])) == len(case["losses"]), "the loss moved"


@pytest.mark.parametrize("stage", range(4))
def test_qwen3_bf16_within_bf16_rounding_of_the_unsplit_model(world4, stage):
    for rank, out in enumerate(world4):
        case = out["cases"][("qwen3", "bf16", stage, "")]
        losses, norms, ref = case["losses"], case["norms"], case["reference"]
        assert abs(losses[0] - ref["losses"][0]) <= BF16_FIRST_LOSS, (rank, losses, ref["losses"])
        assert abs(norms[0] - ref["norms"][0]) <= BF16_FIRST_NORM * ref["norms"][0], (rank, norms, ref["norms"])
        assert _close(losses[1:], ref["losses"][1:], BF16_LATER), (rank, losses, ref["losses"])


@pytest.mark.parametrize("stage, offload", [(2, "optimizer"), (3, "param")])
def test_offload(world4, stage, offload):
    for rank, out in enumerate(world4):
        case = out["cases"][("llama", "fp32", stage, offload)]
        ref = case["reference"]
        assert _close(case["losses"], ref["losses"], FP32_TOL) and _close(case["norms"], ref["norms"], FP32_TOL)
        assert case["weight_error"] <= FP32_TOL, (rank, case["weight_error"])


def test_to_fp32_assembles_the_pieces(world4, workdir):
    """`zeroshard to-fp32` (no process group) reads the tp 2 x dp 2 checkpoint as whole tensors."""
    from zeroshard.checkpoint import consolidate_fp32

    want = world4[0]["cases"][("llama", "fp32", 2, "")]["checkpoint_reference"]
    state = consolidate_fp32(os.path.join(workdir, "ckpt"), tag="tp")
    assert sorted(state) == sorted(want)
    for name, value in want.items():
        assert state[name].shape == value.shape and float((state[name] - value).abs().max()) <= FP32_TOL, name


def test_to_deepspeed_writes_whole_tensors(world4, workdir, tmp_path):
    """`zeroshard to-deepspeed` of the tp 2 x dp 2 checkpoint: a DeepSpeed (data-parallel, stage 2,
    world 2) checkpoint whose tensors, read back, are the whole ones `to-fp32` gives."""
    from zeroshard.checkpoint import consolidate_fp32
    from zeroshard.checkpoint.deepspeed.convert import to_deepspeed
    from zeroshard.checkpoint.deepspeed.read_ds import read_deepspeed

    out = to_deepspeed(os.path.join(workdir, "ckpt"), tmp_path, tag="tp", stage=2, world_size=2)
    back = read_deepspeed(out)
    whole = consolidate_fp32(os.path.join(workdir, "ckpt"), tag="tp")
    assert sorted(back.masters) == sorted(whole)
    for name, value in whole.items():
        assert float((back.masters[name] - value).abs().max()) == 0.0, name


def test_tensor_collectives_per_step(world4):
    """Per transformer block, two all-reduces forward (o_proj, down_proj) and two backward (the
    attention and MLP inputs, one each: docs/tensor-parallel.md); the untied head gathers its
    logits forward and sums its input's gradient backward; Qwen3 adds q_norm's and k_norm's
    gradient sums. Two blocks here. Every one on the rank's tensor group, none on the world."""
    blocks = 2
    for rank, out in enumerate(world4):
        group = (0, 1) if rank < 2 else (2, 3)
        for kind, precision, extra in (("llama", "fp32", 0), ("qwen3", "bf16", 2 * blocks)):
            log = out["cases"][(kind, precision, 0, "")]["collectives"]
            tensor = [(tag, op, forward) for tag, op, ranks, forward in log if tag.startswith("tp.")]
            assert all(ranks == group for tag, _, ranks, _ in log if tag.startswith("tp.")), log
            assert Counter(tensor) == Counter({
                ("tp.forward", "all_reduce", True): 2 * blocks,
                ("tp.forward", "all_gather", True): 1,
                ("tp.backward", "all_reduce", False): 2 * blocks + 1,
                **({("tp.grad_sum", "all_reduce", False): extra} if extra else {}),
            }), (kind, Counter(tensor))


def test_resume_at_tensor_1_data_4(world4):
    for rank, out in enumerate(world4):
        got = out["resume_tp1_dp4"]
        ref = out["cases"][("llama", "fp32", 2, "")]["reference"]
        assert (got["tp"], got["dp"], got["step"]) == (1, 4, 3)
        assert got["loaded_error"] <= FP32_TOL and got["after_error"] <= FP32_TOL, (rank, got)
        assert abs(got["loss"] - ref["losses"][2]) <= FP32_TOL and abs(got["norm"] - ref["norms"][2]) <= FP32_TOL


def test_resume_at_tensor_2_data_1(world4, world2):
    ref = world4[0]["cases"][("llama", "fp32", 2, "")]["reference"]
    for rank, out in enumerate(world2):
        got = out["resume"]
        assert (got["tp"], got["dp"], got["step"]) == (2, 1, 3)
        assert got["memory_check"] == (False, "tensor-parallel model"), got["memory_check"]  # a budget was set
        assert got["loaded_error"] <= FP32_TOL and got["after_error"] <= FP32_TOL, (rank, got)
        assert abs(got["loss"] - ref["losses"][2]) <= FP32_TOL and abs(got["norm"] - ref["norms"][2]) <= FP32_TOL


def test_deepspeed_autotp_checkpoint_resumes_at_its_layout(world2):
    """DeepSpeed 0.19.8's tp2 x dp1 stage-1 fp32 save: each rank's pieces equal what DeepSpeed read
    on that tensor rank (exactly after the load; after its 2 more steps within FP32_TOL: the two
    engines' reductions and clipping order their float32 sums differently)."""
    for rank, out in enumerate(world2):
        got = out["deepspeed"]
        assert got["loaded_error"] == 0.0, (rank, got)
        assert got["after_error"] <= FP32_TOL, (rank, got)


def test_the_benchmarks_cell(world2):
    """benchmarks/autotp_conformance.py's code on one cell (the GPU check runs its grid): fp32
    losses and norms within FP32_TOL of the unsplit model, 10 tensor exchanges per micro-step
    (two blocks: 4 + 1 forward, 4 + 1 backward, as test_tensor_collectives_per_step), and each
    rank holding fewer parameters than the whole model."""
    for rank, out in enumerate(world2):
        (row,), whole = out["benchmark"]["rows"], out["benchmark"]["whole_params"]
        assert (row["tp"], row["dp"], row["stage"]) == (2, 1, 3), row
        assert row["loss_diff"] <= FP32_TOL and row["norm_diff"] <= FP32_TOL, (rank, row)
        assert row["tp_collectives_per_micro_step"] == 10, (rank, row)
        assert whole // 2 < row["params_per_rank"] < whole, (rank, row, whole)


def test_16bit_export_is_the_whole_model_and_from_pretrained_loads_it(world4):
    case = world4[0]["cases"][("llama", "fp32", 3, "")]
    exported, loaded, want = case["export"]["state"], case["export"]["loaded"], case["export_reference"]
    assert sorted(exported) == sorted(want) == sorted(loaded)
    for name, value in exported.items():
        assert value.shape == want[name].shape, name  # whole, not a piece
        assert float((value - want[name]).abs().max()) <= FP32_TOL, name
        assert float((loaded[name] - value).abs().max()) == 0.0, name
    assert all(out["cases"][("llama", "fp32", 3, "")]["export"] is None for out in world4[1:])


def test_different_inputs_on_a_tensor_group_are_refused_on_every_rank(world4):
    for out in world4:
        assert out["input_check"].startswith("tensor parallelism: the first batch differs across the tensor-parallel")
        assert "engine.data_parallel_group" in out["input_check"]


def test_the_documented_example_trains(dist_pool):
    """docs/tensor-parallel.md's example on 4 ranks: tensor 2 x data 2, the loss falls, and both
    ranks of a tensor group report the same loss (they compute the same samples)."""
    import re

    runs = dist_pool(4).run("tests.dist.scenarios.autotp:run_example", "examples/train_tensor_parallel.py",
                            "examples/configs/zero2_autotp.json", timeout=TIMEOUT_S)
    losses = {}
    for rank, printed in enumerate(runs):
        assert f"rank {rank}: tensor parallel 2 x data parallel 2" in printed, printed
        losses[rank] = [float(v) for v in re.findall(r"step \d+ loss ([0-9.]+)", printed)]
        assert len(losses[rank]) == 3 and losses[rank][-1] < losses[rank][0], printed
    assert losses[0] == losses[1] and losses[2] == losses[3]
