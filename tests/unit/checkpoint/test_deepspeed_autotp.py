"""DeepSpeed 0.19.8 AutoTP checkpoints (tensor_parallel.autotp_size 2; the fixtures were written by
the real DeepSpeed: tests/fixtures/deepspeed/regenerate.py, autotp_side.py) read by zeroshard.

Reading: the pieces DeepSpeed saved per tensor-parallel rank are joined into whole tensors
(checkpoint/deepspeed/read_autotp.py). The independent check: cut the whole tensors again by
zeroshard's own plan of the model (column or row, from its tp_plan) and compare each piece with
what DeepSpeed's `safe_get_full_fp32_param` / `safe_get_full_optimizer_state` read on that
tensor rank at the save: tolerance 0 (only elements move). The universal checkpoint that
DeepSpeed's ds_to_universal made from one of them reads the same.

Resuming: one zeroshard process (no tensor parallelism) loads the fp32 fixtures and trains
M_STEPS on the global batch DeepSpeed's data ranks trained on; DeepSpeed's own uninterrupted
run is the reference. Right after the load: tolerance 0. After: 1e-5 absolute, because
DeepSpeed summed the row-split layers' partial products over two tensor ranks where zeroshard
computes one matmul (float32 reordering, measured below 2e-6 after 2 AdamW steps).
"""

from __future__ import annotations

import functools
import importlib.util
import sys
import types

import pytest
import torch

import zeroshard
from tests.unit.autotp.models import build
from tests.unit.checkpoint.deepspeed_fixtures import FIXTURES
from zeroshard.autotp.plan import plan_tensor_parallel
from zeroshard.autotp.split import TensorSplit
from zeroshard.checkpoint.deepspeed.convert import read_any_deepspeed
from zeroshard.zero.full_tensors import safe_get_full_fp32_param, safe_get_full_optimizer_state

CASES = ["tp2_s1_fp32_w2", "tp2_s2_bf16_w4", "tp2_s3_fp32_w4"]
AFTER_TOL = 1e-5


def side():
    """tests/fixtures/deepspeed/autotp_side.py: the batches and config DeepSpeed ran."""
    if "ds_autotp_side" not in sys.modules:
        spec = importlib.util.spec_from_file_location("ds_autotp_side", FIXTURES / "autotp_side.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["ds_autotp_side"] = module
        spec.loader.exec_module(module)
    return sys.modules["ds_autotp_side"]


def expected(case: str) -> dict:
    return torch.load(FIXTURES / case / "expected_ds.pt", weights_only=True)


@functools.cache
def placements(parts: int = 2) -> dict:
    """zeroshard's plan of the tiny Llama (its tp_plan), by layer name."""
    settings = types.SimpleNamespace(preset_model=None, partition_config=None, vocab_parallel_lm_head=None)
    return plan_tensor_parallel(build("llama", device="meta"), settings, parts).by_name()


def pieces_of(name: str, whole: torch.Tensor, tp_rank: int, parts: int = 2) -> torch.Tensor:
    """`whole` cut as zeroshard's plan of the tiny Llama cuts it."""
    placement = placements(parts).get(name.rsplit(".", 1)[0])
    if placement is None or placement.dim is None:
        return whole
    return TensorSplit(placement.dim, parts, tp_rank, tuple(whole.shape)).piece_of(whole)


def assert_pieces(state_masters, state_moments, want: dict, tol: float = 0.0) -> None:
    for tp_rank, snapshot in want.items():
        for name, value in snapshot["fp32"].items():
            got = pieces_of(name, state_masters[name].float(), tp_rank)
            torch.testing.assert_close(got, value, rtol=0, atol=tol, msg=f"tensor rank {tp_rank}: {name}")
            for key in ("exp_avg", "exp_avg_sq"):
                got = pieces_of(name, state_moments[name][key].float(), tp_rank)
                torch.testing.assert_close(got, snapshot[key][name], rtol=0, atol=tol,
                                           msg=f"tensor rank {tp_rank}: {key} of {name}")


@pytest.mark.parametrize("case", CASES)
def test_reads_the_pieces_deepspeed_saved(case: str) -> None:
    tp, stage, precision, world = side().parse_case(case)
    state = read_any_deepspeed(FIXTURES / case / "ckpt" / "global_step3")
    assert (state.stage, state.precision, state.world_size) == (stage, precision, world // tp)
    want = expected(case)["at_save"]
    assert sorted(want) == [0, 1]
    assert_pieces(state.masters, state.optimizer_state, want)
    assert state.masters["model.layers.0.self_attn.o_proj.weight"].shape == (32, 32)  # whole, not a piece
    assert state.steps == [3.0] and state.global_steps == 3
    assert state.client_state == {"epoch": 7, "note": "from deepspeed autotp"}


def test_reads_the_universal_checkpoint_of_an_autotp_save() -> None:
    universal = read_any_deepspeed(FIXTURES / "universal_autotp" / "global_step3")
    assert_pieces(universal.masters, universal.optimizer_state, expected("tp2_s2_bf16_w4")["at_save"])


@pytest.mark.parametrize("case", ["tp2_s1_fp32_w2", "tp2_s3_fp32_w4"])
def test_resumes_where_deepspeed_ends(case: str) -> None:
    ds = side()
    tp, stage, precision, world = ds.parse_case(case)
    dp = world // tp
    config = ds.ds_config(case)
    del config["tensor_parallel"]
    config["train_micro_batch_size_per_gpu"] = ds.MICRO * dp  # the data ranks' batches, side by side
    model = build("llama", seed=3)  # other weights: all must come from the checkpoint
    engine, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=config)
    engine.load_checkpoint(str(FIXTURES / case / "ckpt"))
    want = expected(case)

    def snapshot():
        masters = {n: safe_get_full_fp32_param(p) for n, p in engine.module.named_parameters()}
        moments = {n: {k: safe_get_full_optimizer_state(p, k) for k in ("exp_avg", "exp_avg_sq")}
                   for n, p in engine.module.named_parameters()}
        return masters, moments

    assert_pieces(*snapshot(), want["at_save"])
    losses = []
    for step in range(ds.K_STEPS, ds.K_STEPS + ds.M_STEPS):
        ids = torch.cat([ds.batch(step, r) for r in range(dp)])
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    assert_pieces(*snapshot(), want["after"], tol=AFTER_TOL)
    ds_losses = [sum(want["losses_after"][r][i] for r in range(dp)) / dp for i in range(ds.M_STEPS)]
    assert losses == pytest.approx(ds_losses, abs=AFTER_TOL)
