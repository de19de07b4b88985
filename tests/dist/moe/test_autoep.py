"""AutoEP on tiny Hugging Face MoE models (Mixtral, Qwen3-MoE, DeepSeek-V3; for the forward
also Qwen2-MoE with its gated shared expert and DeepSeek-V2 with group-limited greedy routing)
built from a config (transformers, no download), at world size 4 (autoep_size 1, 2, 4) and 2.

* The swapped model's forward equals the unswapped model's on the same batch: logits, every
  layer's router logits, the auxiliary loss, and each router's chosen experts (DeepSeek-V3 with
  a non-zero score-correction bias that changes the choice).
* Under the engine, training does not depend on autoep_size: losses, gradient norms and the
  fp32 masters after 2 steps (accumulation 2) equal autoep_size 1's, at ZeRO 0-3 and in bf16.
"""

from __future__ import annotations

import pytest
import torch

from tests.dist.scenarios.autoep import COEFF, KINDS, MORE_KINDS, STEPS, balance_case, forward_cases, train_cases

pytest.importorskip("transformers")

TIMEOUT_S = 900
FORWARD_4 = [(kind, size) for kind in KINDS + MORE_KINDS for size in (1, 2, 4)]
FORWARD_2 = [(kind, size) for kind in KINDS for size in (1, 2)]
# fp32, same products: the experts' gate and up projections are two matmuls here and one fused
# matmul there, and each token's k routes are summed in another order, so results differ in
# the last bits (observed <= 3e-8 on logits of size ~0.5).
FORWARD_TOL = 1e-5

TRAIN = [("deepseek_v3", size, stage, "fp32") for stage in (0, 1, 2, 3) for size in (1, 2, 4)] + [
    ("mixtral", size, 2, "fp32") for size in (1, 4)
] + [("qwen3_moe", size, 3, "fp32") for size in (1, 2)] + [("deepseek_v3", size, 2, "bf16") for size in (1, 4)]
# fp32: gradients of the same products summed in another order (an expert's gradient is one
# rank's autograd sum over the tokens of 4 ranks at autoep_size 4, four partial sums reduced
# at autoep_size 1); AdamW's first steps divide by sqrt(v) ~ |g|, which turns a 1e-7 relative
# gradient difference into at most ~1e-6 of lr = 1e-2 after 2 steps.
FP32 = {"atol": 1e-5, "rtol": 1e-4}
# bf16: parameters and activations round to 8 bits and the expert matmuls group tokens
# differently; AdamW moves each weight by at most ~lr per step, so 2 steps bound a difference
# by 2 x lr = 0.02; the observed gap is far below this bound.
BF16 = {"atol": 2e-2, "rtol": 5e-2}


@pytest.fixture(scope="module")
def world4(dist_pool):
    forward = dist_pool(4).run(forward_cases, FORWARD_4, timeout=TIMEOUT_S)
    train = dist_pool(4).run(train_cases, TRAIN, timeout=TIMEOUT_S)
    balance = dist_pool(4).run(balance_case, 2, 3, timeout=TIMEOUT_S)
    return forward, train, balance


@pytest.fixture(scope="module")
def world2(dist_pool):
    return dist_pool(2).run(forward_cases, FORWARD_2, timeout=TIMEOUT_S)


def _check_forward(results, cases, world):
    for rank in range(world):
        for (kind, size), r in zip(cases, results[rank], strict=True):
            label = f"{kind} autoep_size={size} rank {rank}"
            assert r["logits"] <= FORWARD_TOL * max(1.0, r["logit_scale"]), (label, r)
            assert r["num_router_logits"][0] == r["num_router_logits"][1] > 0, (label, r)
            assert r["router_logits"] <= FORWARD_TOL, (label, r)
            if not kind.startswith("deepseek"):  # DeepSeek's causal LMs compute no auxiliary loss
                assert r["aux"] is not None and r["aux"] <= FORWARD_TOL, (label, r)
            assert r["choices_equal"], label
            experts = 8 if kind.startswith("deepseek") else 4
            assert all(shape[0] == experts // size for shape in r["local_experts"]), (label, r)
            if kind == "deepseek_v3":
                assert r["bias_changes_choice"], label
                assert r["route_scale"] == pytest.approx(2.446), label


def test_forward_equals_unswapped_model_world_4(world4) -> None:
    _check_forward(world4[0], FORWARD_4, 4)


def test_forward_equals_unswapped_model_world_2(world2) -> None:
    _check_forward(world2, FORWARD_2, 2)


def merged(train, index: int, step: int) -> dict[str, torch.Tensor]:
    """Every rank's masters by global name; ranks holding the same tensor must agree exactly."""
    out: dict[str, torch.Tensor] = {}
    for rank in range(4):
        for name, value in train[rank][index]["masters"][step].items():
            if name in out:
                torch.testing.assert_close(value, out[name], atol=0, rtol=0, msg=f"{name} differs between ranks")
            out[name] = value
    return out


@pytest.mark.parametrize("case", [c for c in TRAIN if c[1] > 1], ids=lambda c: f"{c[0]}-ep{c[1]}-stage{c[2]}-{c[3]}")
def test_training_equals_autoep_size_one(world4, case) -> None:
    kind, size, stage, mode = case
    tol = FP32 if mode == "fp32" else BF16
    train = world4[1]
    i, base = TRAIN.index(case), TRAIN.index((kind, 1, stage, mode))
    for rank in range(4):
        mine, theirs = train[rank][i], train[rank][base]
        assert mine["losses"] == pytest.approx(theirs["losses"], rel=tol["rtol"]), rank
        assert mine["norms"] == pytest.approx(theirs["norms"], rel=tol["rtol"]), rank
    for step in range(STEPS):
        mine, theirs = merged(train, i, step), merged(train, base, step)
        assert set(mine) == set(theirs)
        for name, value in theirs.items():
            torch.testing.assert_close(
                mine[name], value, **tol, msg=lambda m, n=name, s=step: f"{case} step {s + 1} {n}: {m}"
            )
    # The masters moved: the comparison is not between two untouched models.
    first, last = merged(train, base, 0), merged(train, base, STEPS - 1)
    assert any(not torch.equal(first[n], last[n]) for n in first)


def test_load_balance_moves_the_bias_by_coeff_centred(world4) -> None:
    """load_balance_coeff: after one optimizer step the bias moved by coeff * sign(mean - count),
    centred, with the counts of every rank's tokens (taken from the unswapped model's router,
    float64 formula here); every rank holds the same bias; the counts restart."""
    balance = world4[2]
    counts = sum(r["counts"].double() for r in balance)
    assert counts.sum() == 4 * 2 * 2 * 6 * 2  # ranks x micro-batches x batch x sequence x top_k
    delta = COEFF * torch.sign(counts.mean() - counts)
    delta = delta - delta.mean()
    assert delta.abs().max() > 0
    for rank, r in enumerate(balance):
        moved = (r["after"] - r["before"]).double()
        torch.testing.assert_close(moved, delta, atol=1e-7, rtol=0, msg=lambda m, k=rank: f"rank {k}: {m}")
        torch.testing.assert_close(r["after"], balance[0]["after"], atol=0, rtol=0)
        assert r["pending"] is None, rank
    uncentred = moved + (COEFF * torch.sign(counts.mean() - counts)).mean()
    # each expert's own move is +-coeff (0 at exactly the mean), up to the fp32 bias's rounding
    assert all(min(abs(v - COEFF), v) < 1e-7 for v in uncentred.abs().tolist()), uncentred
    assert abs(moved.sum().item()) < 1e-7


def test_load_balance_refused_without_a_selection_bias() -> None:
    from tests.dist.scenarios.autoep import build_hf
    from zeroshard.config.expert_parallel import ExpertParallelConfig
    from zeroshard.module_inject.auto_ep import replace_moe_layers

    with pytest.raises(ValueError, match=r"expert_parallel.load_balance_coeff=0.001: .* Remove load_balance_coeff"):
        replace_moe_layers(build_hf("mixtral"), ExpertParallelConfig(enabled=True, load_balance_coeff=1e-3), 1)
