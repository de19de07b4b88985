"""MoE under the engine at world size 4 (gloo): expert flats sharded over the expert-data-
parallel group, every stage, ep_size 1, 2 and 4.

Rank r sees the same micro-batches for every ep_size and stage, so:
* the first step's gradients and its global norm equal a plain-torch computation in this
  process: the sum over ranks and micro-steps of each rank's loss / (world x accumulation),
  with one MoE layer holding all experts (fp32);
* the fp32 masters after 2 steps (accumulation 2, AdamW, clipping active) equal ep_size 1's;
* in bf16 the same, at bf16's tolerance.
"""

from __future__ import annotations

import pytest
import torch

from tests.dist.scenarios.moe_engine import (
    GA,
    STEPS,
    EngineCase,
    build_model,
    global_names,
    micro_batch,
    rng_seed,
    train_cases,
)

WORLD = 4
TIMEOUT_S = 900
STAGES = (0, 1, 2, 3)
EP_SIZES = (1, 2, 4)
CASES = [EngineCase(ep, stage, mode) for mode in ("fp32", "bf16") for stage in STAGES for ep in EP_SIZES] + [
    EngineCase(ep, 2, user_groups=True) for ep in EP_SIZES
] + [EngineCase(ep, 3, skewed=True) for ep in EP_SIZES]
# fp32: the same products summed in another order (expert gradients: one rank's autograd sum
# over 4 ranks' tokens at ep_size 4, 4 ranks' partial sums reduced at ep_size 1).
FP32 = {"atol": 1e-6, "rtol": 1e-5}
# bf16: parameters and activations round to 8 bits; a gradient computed from differently
# grouped bf16 matmuls differs by a few bf16 ulps. AdamW moves each weight by at most about
# lr per step, so 2 steps bound a difference by 2 x lr = 0.02; the observed gap is far below.
BF16 = {"atol": 5e-3, "rtol": 1e-2}


@pytest.fixture(scope="module")
def runs(dist_pool):
    return dist_pool(WORLD).run(train_cases, CASES, timeout=TIMEOUT_S)


def merged(runs, index: int, key: str, step: int | None = None) -> dict[str, torch.Tensor]:
    """Every rank's tensors by global name; ranks holding the same tensor must agree exactly."""
    out: dict[str, torch.Tensor] = {}
    for rank in range(WORLD):
        values = runs[rank][index][key]
        values = values[step] if step is not None else values
        for name, value in values.items():
            if name in out:
                torch.testing.assert_close(value, out[name], atol=0, rtol=0, msg=f"{name} differs between ranks")
            else:
                out[name] = value
    return out


@pytest.fixture(scope="module")
def reference():
    """First-step gradients and norm in plain torch (one process, ep_size 1)."""
    model = build_model(ep_size=1)
    for rank in range(WORLD):
        torch.manual_seed(rng_seed(rank))
        for micro in range(GA):
            x, y = micro_batch(rank, 0, micro)
            (model(x, y) / (WORLD * GA)).backward()
    grads = {name: p.grad for name, p in global_names(model).items()}
    norm = torch.sqrt(sum(g.double().pow(2).sum() for g in grads.values())).item()
    return grads, norm


def index_of(case: EngineCase) -> int:
    return CASES.index(case)


@pytest.mark.parametrize("case", [c for c in CASES if c.mode == "fp32" and not c.skewed], ids=lambda c: c.label)
def test_first_step_gradients_and_norm_equal_plain_torch(runs, reference, case) -> None:
    grads, norm = reference
    i = index_of(case)
    mine = merged(runs, i, "grad0")
    assert set(mine) == set(grads)
    for name, grad in grads.items():
        torch.testing.assert_close(mine[name].float(), grad, **FP32, msg=lambda m, n=name: f"{case.label} {n}: {m}")
    for rank in range(WORLD):
        assert runs[rank][i]["norms"][0] == pytest.approx(norm, rel=1e-5), case.label
    assert norm > 0.5  # clipping (at 0.5) is active


@pytest.mark.parametrize("case", [c for c in CASES if c.ep_size > 1], ids=lambda c: c.label)
def test_parameters_after_two_steps_equal_ep_size_one(runs, case) -> None:
    tol = FP32 if case.mode == "fp32" else BF16
    i, base = index_of(case), index_of(EngineCase(1, case.stage, case.mode, skewed=case.skewed))
    for step in range(STEPS):
        mine, theirs = merged(runs, i, "masters", step), merged(runs, base, "masters", step)
        for name, value in theirs.items():
            torch.testing.assert_close(
                mine[name], value, **tol, msg=lambda m, n=name, s=step: f"{case.label} step {s + 1} {n}: {m}"
            )
        for rank in range(WORLD):
            assert runs[rank][i]["norms"][step] == pytest.approx(runs[rank][base]["norms"][step], rel=tol["rtol"])


@pytest.mark.parametrize(
    "case", [c for c in CASES if c.mode == "fp32" and c.stage == 3 and not c.skewed], ids=lambda c: c.label
)
def test_expert_flats_sharded_over_expert_data_parallel_group(runs, case) -> None:
    i = index_of(case)
    for rank in range(WORLD):
        edp = tuple(range(rank % case.ep_size, WORLD, case.ep_size))
        groups = runs[rank][i]["flat_groups"]
        assert (tuple(range(WORLD)), False) in groups
        assert {g for g, is_expert in groups if is_expert} == {edp}


@pytest.mark.parametrize("ep_size", EP_SIZES)
def test_optimizer_groups_keep_experts_apart(runs, ep_size) -> None:
    """From the config, the engine splits expert parameters into a group of their own (dense
    first); with model_parameters from split_params_into_different_moe_groups_for_optimizer it
    keeps the user's groups. The groups hold the flats' masters: one dense flat per unit (the
    root and the 2 blocks) and one expert flat per block."""
    dense, experts = 3, 2
    for rank in range(WORLD):
        config_made = runs[rank][index_of(EngineCase(ep_size, 2))]["optimizer_groups"]
        assert config_made == [("dense-params", False, dense), (f"ep_size_{ep_size}", True, experts)]
        user = runs[rank][index_of(EngineCase(ep_size, 2, user_groups=True))]
        assert user["optimizer_groups"] == [("all", False, dense), (f"ep_size_{ep_size}", True, experts)]
        base = runs[rank][index_of(EngineCase(ep_size, 2))]
        for step in range(STEPS):
            for name, value in base["masters"][step].items():
                torch.testing.assert_close(user["masters"][step][name], value, atol=0, rtol=0)


def test_experts_without_tokens_at_stage_3(runs) -> None:
    """Every token goes to expert 0 in the first step: at ep_size 4 ranks 1-3 hold experts that
    got nothing, yet stage 3 gathers, reduces and steps on every rank (no hang, the pool's
    timeout would say so), their gradients are exactly zero, and training equals ep_size 1
    (test_parameters_after_two_steps_equal_ep_size_one covers the skewed cases too)."""
    grads = merged(runs, index_of(EngineCase(4, 3, skewed=True)), "grad0")
    expert_grads = {n: g for n, g in grads.items() if ".deepspeed_experts." in n}
    assert len(expert_grads) == 2 * 4 * 4
    for name, grad in expert_grads.items():
        expert = int(name.split(".deepspeed_experts.")[1].split(".")[0])
        assert (torch.count_nonzero(grad) == 0) == (expert != 0), name


@pytest.mark.parametrize("stage", STAGES)
def test_overflow_in_one_ranks_expert_skips_the_step_everywhere(dist_pool, stage) -> None:
    from tests.dist.scenarios.moe_engine import overflow_on_one_rank

    for rank, result in enumerate(dist_pool(WORLD).run(overflow_on_one_rank, stage, timeout=TIMEOUT_S)):
        assert result["skipped"] == 1, rank
        assert result["unchanged"], rank
        assert result["scale"] == (256.0, 128.0), rank
