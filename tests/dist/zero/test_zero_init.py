"""`zeroshard.zero.Init` at stage 3, 2 ranks: only each rank's part of every parameter exists
after construction, and the model trains exactly as one built without Init.

- Held: every parameter reads as empty (numel 0) with its full `ds_shape`/`ds_numel`, and this
  rank keeps ceil(numel / 2) elements (`ds_tensor`); tied weights stay one parameter; buffers are
  whole. TinyModel's constructor writes `embed.weight` after building the embedding (gathered on
  access, partitioned again after the constructor), so its values test that path too.
- Values: `GatheredParameters` before initialize gives the values a plain build has, bitwise
  (same seed; Init broadcasts rank 0's values as the engine does without Init); training gives
  bitwise the masters of the plain build (fp32: also within the fp32 tolerance of the
  single-process reference; bf16 with `dtype=torch.bfloat16`: the parts are rounded where the
  engine would round them, so still bitwise).
- Corners: a parameter read or written by a parent after its child was built, through `.data`,
  assigned to a child later, a class defined inside the context, `GatheredParameters(...,
  modifier_rank=0)` before initialize, `Init(module=...)`, the no-op cases and refused options.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.dist.reference import TOLERANCES, TrainSettings, cached_reference

TIMEOUT_S = 300
MUON = {"optimizer": {"type": "Muon", "params": {
    "muon_lr": 0.02, "adam_lr": 1e-2, "momentum": 0.95, "weight_decay": 0.1, "betas": [0.9, 0.999], "eps": 1e-8,
}}}


@pytest.fixture(scope="module")
def runs(dist_pool):
    pool = dist_pool(2)
    return {
        "fp32": pool.run("tests.dist.scenarios.zero_init:build_under_init", 3, "fp32", timeout=TIMEOUT_S),
        "bf16": pool.run("tests.dist.scenarios.zero_init:build_under_init", 3, "bf16", torch.bfloat16,
                         timeout=TIMEOUT_S),
        # Muon chooses matrices by full shape before initialize gathers them (ds_shape).
        "muon": pool.run("tests.dist.scenarios.zero_init:build_under_init", 3, "fp32", None, MUON, timeout=TIMEOUT_S),
        "corners": pool.run("tests.dist.scenarios.zero_init:init_corners", timeout=TIMEOUT_S),
        "scaled": pool.run("tests.dist.scenarios.zero_init:train_scaled_model", timeout=TIMEOUT_S),
        "adapter": pool.run("tests.dist.scenarios.zero_init:fp32_adapter_on_bf16_base", timeout=TIMEOUT_S),
    }


@pytest.mark.parametrize("mode", ["fp32", "bf16", "muon"])
def test_only_parts_are_held_after_construction(runs, mode) -> None:
    for rank, out in enumerate(runs[mode]):
        assert out["active"]
        assert out["tied"], "head.weight is embed.weight after Init"
        for name, held in out["held"].items():
            shape = out["plain_initial"][name].shape
            assert held["numel"] == 0, (rank, name, held)
            assert held["ds_shape"] == tuple(shape) and held["ds_numel"] == math.prod(shape), (rank, name, held)
            assert held["part"] == max(1, math.ceil(math.prod(shape) / 2)), (rank, name, held)
        assert out["after_gathered"] == out["held"], "GatheredParameters partitions again on exit"


@pytest.mark.parametrize("mode", ["fp32", "bf16", "muon"])
def test_values_and_training_equal_a_plain_build(runs, mode) -> None:
    for rank, out in enumerate(runs[mode]):
        for name, value in out["gathered"].items():
            expected = out["plain_initial"][name]
            if mode == "bf16":
                expected = expected.to(torch.bfloat16)  # Init(dtype=bf16) rounds where the engine would
            assert value.dtype == expected.dtype and torch.equal(value, expected), (rank, name)
        for step in range(2):
            for name, value in out["inside"]["master"][step].items():
                assert torch.equal(value, out["plain"]["master"][step][name]), (rank, step, name)
        for name, grad in out["inside"]["grad0"].items():
            assert torch.equal(grad, out["plain"]["grad0"][name]), (rank, name)


def test_training_matches_the_reference(runs) -> None:
    """fp32 against the single-process fp32 reference (reference.TOLERANCES: same sums in
    another order, <= 1e-6 absolute on parameters after AdamW steps)."""
    out = runs["fp32"][0]
    ref = cached_reference(0, 2, 2 * 2 * 2, "fp32", TrainSettings())  # W 2 x micro 2 x k 2 rows
    tol = TOLERANCES["fp32"]
    for step in range(2):
        for name, value in out["inside"]["master"][step].items():
            torch.testing.assert_close(value, ref.params[step][name], atol=tol.param_atol, rtol=tol.param_rtol,
                                       msg=f"step {step} {name}")


def test_module_init_corner_cases(runs) -> None:
    for rank, out in enumerate(runs["corners"]):
        for name, held in out["held"].items():
            assert held["numel"] == 0 and held["part"] is not None, (rank, name, held)
        assert torch.equal(out["buffer"], torch.arange(16, dtype=torch.float32) / 16), "buffers stay whole"
        for name, value in out["plain"].items():
            assert torch.equal(out["inside"][name], value), (rank, name)
        assert out["patched_after_exit"] is False, "the constructors are restored on exit"
        assert out["late"] == (0, (5,))
        assert torch.equal(out["modified"], torch.full((16,), 7.0)), "modifier_rank 0's values on every rank"
        assert out["stage1"] == (False, 16, False) and out["disabled"] == (False, 16, False)
        assert out["module_arg_numel"] == 0 and out["module_arg_equal"]
        for option, message in out["refused"].items():
            assert message is not None and option in message, (option, message)


def test_corner_case_model_trains_as_without_init(runs) -> None:
    for rank, out in enumerate(runs["scaled"]):
        for name, value in out["plain"].items():
            assert torch.equal(out["inside"][name], value), (rank, name)
        assert torch.equal(out["inside_buffer"], out["plain_buffer"])


def test_fp32_adapter_attached_to_an_init_built_bf16_base_trains(runs) -> None:
    """DeepSpeed 0.19's TestZero3AutocastMixedDtype: `convert_to_zero_parameters` partitions the
    adapters (in their own dtype, fp32), the adapter gets a non-zero gradient and the step moves
    it. The gradient is checked against plain torch on the values the engine computed with,
    under the same bf16 autocast (tolerance 2e-2, relative to the largest entry: bf16 matmuls
    summed in another order, an fp32 reduction of two equal halves). zeroshard computes with the
    adapter in bf16 (the bf16 section's dtype) where DeepSpeed keeps it fp32: a difference the migration guide lists."""
    from tests.dist.scenarios.zero_init import MixedDtypeAdapterModule

    for out in runs["adapter"]:
        assert out["adapter_parts"] == [torch.float32, 0]  # partitioned, fp32 part, empty data
        assert out["dtypes"]["base_weight"] == torch.bfloat16
        reference = MixedDtypeAdapterModule(8)
        reference.adapter_a = torch.nn.Parameter(out["values"]["adapter_a"].clone())
        reference.adapter_b = torch.nn.Parameter(out["values"]["adapter_b"].clone())
        reference.base_weight = torch.nn.Parameter(out["values"]["base_weight"].clone(), requires_grad=False)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = reference(*out["batch"])
        loss.backward()
        for name in ("adapter_a", "adapter_b"):
            got = out["grads"][name]
            assert got is not None and torch.count_nonzero(got) > 0, name
            want = getattr(reference, name).grad.float()
            # bf16 rounds each product to ~3 digits of the largest term: near-zero entries
            # differ by that much in absolute terms, so atol scales with the gradient.
            torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * want.abs().max().item(), msg=name)
        assert not torch.equal(out["before"], out["after"])
