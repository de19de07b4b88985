"""The MoE router's gating functions (zeroshard/moe/sharded_moe.py) against their formulas.

References are written here independently, in float64 Python over the logits: the capacity
`ceil(S / E * capacity_factor * k)` (at least min_capacity), the kept routes per drop policy,
the renormalised gates, and the auxiliary losses. Exact equality where the computation is a
selection; fp32 tolerance (atol 1e-6) where values are compared (the implementation computes
the softmax in fp32, the reference in float64).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from zeroshard.comm import collectives as comm
from zeroshard.moe.layer import MoE
from zeroshard.moe.sharded_moe import top1gating, top2gating, topkgating
from zeroshard.moe.utils import is_moe_param, split_params_into_different_moe_groups_for_optimizer

FP32_ATOL = 1e-6  # fp32 softmax against a float64 one on O(1) values


def softmax64(logits: torch.Tensor) -> list[list[float]]:
    rows = []
    for row in logits.double().tolist():
        top = max(row)
        exps = [math.exp(v - top) for v in row]
        rows.append([e / sum(exps) for e in exps])
    return rows


def kept_routes(indices: torch.Tensor) -> dict[int, set[int]]:
    """expert -> tokens kept for it, from sparse-route indices [k, S]."""
    kept: dict[int, set[int]] = {}
    for route in indices.tolist():
        for token, expert in enumerate(route):
            if expert >= 0:
                kept.setdefault(expert, set()).add(token)
    return kept


@pytest.mark.parametrize(
    "tokens,experts,factor,k,min_capacity",
    [
        (64, 8, 1.0, 1, 4), (10, 3, 1.5, 1, 1), (10, 4, 1.0, 2, 1), (30, 8, 1.25, 3, 2), (6, 8, 1.0, 1, 4),
        (100, 7, 0.3, 2, 0),
    ],
)
def test_capacity_formula(tokens, experts, factor, k, min_capacity) -> None:
    logits = torch.randn(tokens, experts, generator=torch.Generator().manual_seed(tokens))
    expected = max(math.ceil(tokens / experts * factor * k), min_capacity)
    if k == 1:
        out = top1gating(logits, factor, min_capacity, use_rts=False)
    elif k == 2:
        out = top2gating(logits, factor, min_capacity, top2_2nd_expert_sampling=False)
    else:
        out = topkgating(logits, k, factor, min_capacity)
    assert out[1].shape == (tokens, experts, expected)
    sparse = topkgating(logits, k, factor, min_capacity, sparse_routes=True)
    assert int(sparse[1]) == expected


def test_probs_keeps_highest_probability_not_logit() -> None:
    """Capacity 1 per expert, k 2. Token 0 has the larger logit for expert 0 (3 > 2) but the
    smaller probability (0.52 < 0.84, its logit for expert 1 is close behind): "probs" keeps
    token 1 there, "position" the first arrival, token 0."""
    logits = torch.tensor([[3.0, 2.9, -10.0, -10.0], [2.0, 0.0, -1.0, -5.0]])
    probs = softmax64(logits)
    assert logits[0, 0] > logits[1, 0] and probs[0][0] < probs[1][0]
    by_probs = topkgating(logits, 2, 0.25, 1, drop_policy="probs", sparse_routes=True)
    by_position = topkgating(logits, 2, 0.25, 1, drop_policy="position", sparse_routes=True)
    assert int(by_probs[1]) == 1
    assert kept_routes(by_probs[3])[0] == {1}
    assert kept_routes(by_position[3])[0] == {0}
    # expert 1: token 0's probability (0.48) beats token 1's (0.11); position also keeps token 0
    assert kept_routes(by_probs[3])[1] == {0}


@pytest.mark.parametrize("policy", ["probs", "position"])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_drop_policies_match_reference(policy: str, k: int) -> None:
    tokens, experts, factor = 40, 5, 0.6
    logits = torch.randn(tokens, experts, generator=torch.Generator().manual_seed(7 + k))
    probs = softmax64(logits)
    capacity = max(math.ceil(tokens / experts * factor * k), 1)
    choices = [sorted(range(experts), key=lambda e, r=row: -r[e])[:k] for row in probs]
    expected: dict[int, set[int]] = {}
    for expert in range(experts):
        routed = [t for t in range(tokens) if expert in choices[t]]
        if policy == "probs":
            routed = sorted(routed, key=lambda t, e=expert: -probs[t][e])
        if routed[:capacity]:
            expected[expert] = set(routed[:capacity])
    out = topkgating(logits, k, factor, 1, drop_policy=policy, sparse_routes=True)
    assert kept_routes(out[3]) == expected
    # kept gates renormalised over the token's kept routes; location = rank among kept, in token order
    indices, locations, gates = out[3].tolist(), out[4].tolist(), out[5].double()
    for token in range(tokens):
        kept = [(r, indices[r][token]) for r in range(k) if indices[r][token] >= 0]
        total = sum(probs[token][e] for _, e in kept)
        for r, e in kept:
            assert gates[r, token].item() == pytest.approx(probs[token][e] / total, abs=FP32_ATOL)
            assert locations[r][token] == sorted(expected[e]).index(token)
        for r in range(k):
            if indices[r][token] < 0:
                assert gates[r, token].item() == 0.0


def test_aux_losses_match_formula() -> None:
    tokens, experts = 24, 6
    logits = torch.randn(tokens, experts, generator=torch.Generator().manual_seed(3))
    probs = softmax64(logits)
    me = [sum(p[e] for p in probs) / tokens for e in range(experts)]
    order = [sorted(range(experts), key=lambda e, r=row: -r[e]) for row in probs]

    def ce(k: int) -> list[float]:
        return [sum(e in row[:k] for row in order) / tokens for e in range(experts)]

    top1 = experts * sum(m * c for m, c in zip(me, ce(1), strict=True))
    top2 = experts * experts * sum(m * c for m, c in zip(me, ce(1), strict=True)) / experts
    top3 = experts * experts / 3 * sum(m * c for m, c in zip(me, ce(3), strict=True)) / experts
    assert top1gating(logits, 1.0, 1, use_rts=False)[0].item() == pytest.approx(top1, abs=FP32_ATOL)
    assert top2gating(logits, 1.0, 1, top2_2nd_expert_sampling=False)[0].item() == pytest.approx(top2, abs=FP32_ATOL)
    assert topkgating(logits, 3, 1.0, 1)[0].item() == pytest.approx(top3, abs=FP32_ATOL)


def test_top1_and_top2_routes() -> None:
    """Top-1: gate = the chosen probability (not renormalised), first arrivals without RTS.
    Top-2 without sampling: second expert = second-largest logit; every first choice of an
    expert comes before its second choices; gates renormalised over the pair."""
    tokens, experts = 20, 4
    logits = torch.randn(tokens, experts, generator=torch.Generator().manual_seed(11))
    probs = softmax64(logits)
    order = [sorted(range(experts), key=lambda e, r=row: -r[e]) for row in probs]
    capacity = max(math.ceil(tokens / experts * 0.5), 2)
    _, cap, _, idx, loc, gates, counts = top1gating(logits, 0.5, 2, use_rts=False, sparse_routes=True)
    assert int(cap) == capacity
    assert counts.tolist() == [sum(o[0] == e for o in order) for e in range(experts)]
    seen = [0] * experts
    for t in range(tokens):
        e = order[t][0]
        if seen[e] < capacity:
            assert (idx[0, t].item(), loc[0, t].item()) == (e, seen[e])
            assert gates[0, t].item() == pytest.approx(probs[t][e], abs=FP32_ATOL)
        else:
            assert idx[0, t].item() == -1 and gates[0, t].item() == 0.0
        seen[e] += 1

    _, cap2, _, idx, loc, gates, counts = top2gating(
        logits, 1.0, 1, drop_tokens=False, top2_2nd_expert_sampling=False, sparse_routes=True
    )
    firsts = [sum(o[0] == e for o in order) for e in range(experts)]
    assert counts.tolist() == [firsts[e] + sum(o[1] == e for o in order) for e in range(experts)]
    assert int(cap2) == max(counts.tolist())
    seen1, seen2 = [0] * experts, [0] * experts
    for t in range(tokens):
        e1, e2 = order[t][0], order[t][1]
        assert idx[:, t].tolist() == [e1, e2]
        assert loc[:, t].tolist() == [seen1[e1], firsts[e2] + seen2[e2]]
        seen1[e1] += 1
        seen2[e2] += 1
        total = probs[t][e1] + probs[t][e2]
        assert gates[:, t].tolist() == pytest.approx([probs[t][e1] / total, probs[t][e2] / total], abs=FP32_ATOL)


def test_dense_form_matches_sparse_routes() -> None:
    logits = torch.randn(16, 4, generator=torch.Generator().manual_seed(5))
    _, combine, dispatch, _ = topkgating(logits, 2, 0.5, 1)
    _, cap, _, idx, loc, gates, _ = topkgating(logits, 2, 0.5, 1, sparse_routes=True)
    expected = torch.zeros(16, 4, int(cap))
    for r in range(2):
        for t in range(16):
            if idx[r, t] >= 0:
                expected[t, idx[r, t], loc[r, t]] = gates[r, t]
    torch.testing.assert_close(combine, expected, atol=0, rtol=0)
    assert torch.equal(dispatch, expected != 0)


def test_dropless_capacity_without_group_issues_no_collective() -> None:
    logits = torch.randn(12, 3, generator=torch.Generator().manual_seed(2))
    with comm.recording() as log:
        out = topkgating(logits, 2, 0.1, 1, drop_tokens=False, sparse_routes=True)
        top1gating(logits, 0.1, 1, drop_tokens=False, ep_group=None)
    assert log.records == []
    assert int(out[1]) == int(out[6].max()) and (out[3] >= 0).all()


def test_rts_is_reproducible_and_fills_capacity() -> None:
    logits = torch.zeros(32, 2)
    logits[:, 0] = 5.0  # every token prefers expert 0
    torch.manual_seed(1)
    first = top1gating(logits, 1.0, 4, sparse_routes=True)
    torch.manual_seed(1)
    again = top1gating(logits, 1.0, 4, sparse_routes=True)
    assert torch.equal(first[3], again[3])
    kept = kept_routes(first[3])
    assert set(kept) == {0} and len(kept[0]) == 16  # capacity ceil(32 / 2 * 1.0)
    assert kept[0] != set(range(16))  # random, not the first arrivals (probability 1 / C(32, 16))


def test_dropped_token_gets_zero_output() -> None:
    torch.manual_seed(0)
    moe = MoE(4, nn.Linear(4, 4), num_experts=2, k=1, capacity_factor=0.25, min_capacity=1, use_rts=False)
    with torch.no_grad():
        moe.deepspeed_moe.gate.wg.weight.copy_(torch.tensor([[1.0, 1, 1, 1], [-1.0, -1, -1, -1]]))
    x = torch.rand(8, 4) + 0.1  # all tokens choose expert 0; capacity ceil(8 / 2 * 0.25) = 1
    out, _, counts = moe(x)
    assert counts.tolist() == [8, 0]
    assert out[0].abs().sum() > 0
    assert torch.equal(out[1:], torch.zeros(7, 4))


def test_bad_arguments_name_the_argument() -> None:
    expert = nn.Linear(4, 4)
    with pytest.raises(ValueError, match=r"num_experts=6: must be divisible by ep_size \(4\)"):
        MoE(4, expert, num_experts=6, ep_size=4)
    with pytest.raises(ValueError, match=r"k=5: must be between 1 and num_experts \(4\)"):
        MoE(4, expert, num_experts=4, k=5)
    with pytest.raises(ValueError, match=r"use_tutel=True"):
        MoE(4, expert, num_experts=2, use_tutel=True)
    with pytest.raises(ValueError, match=r"enable_expert_tensor_parallelism=True"):
        MoE(4, expert, num_experts=2, enable_expert_tensor_parallelism=True)
    with pytest.raises(ValueError, match=r"noisy_gate_policy='Gauss'"):
        MoE(4, expert, num_experts=2, noisy_gate_policy="Gauss")
    with pytest.raises(ValueError, match=r"drop_policy='logits'"):
        topkgating(torch.zeros(4, 2), 1, 1.0, 1, drop_policy="logits")


def test_state_dict_layout_and_optimizer_groups() -> None:
    moe = MoE(4, nn.Linear(4, 3), num_experts=2, use_residual=True)
    names = set(moe.state_dict())
    assert {
        "deepspeed_moe.gate.wg.weight", "deepspeed_moe.experts.deepspeed_experts.0.weight",
        "deepspeed_moe.experts.deepspeed_experts.1.bias", "mlp.weight", "coefficient.weight",
    } <= names
    assert "deepspeed_moe.gate.wg.bias" not in names
    experts = [p for n, p in moe.named_parameters() if "deepspeed_experts" in n]
    assert all(is_moe_param(p) for p in experts)
    assert not any(is_moe_param(p) for n, p in moe.named_parameters() if "deepspeed_experts" not in n)
    groups = split_params_into_different_moe_groups_for_optimizer(
        {"params": list(moe.parameters()), "name": "dense", "lr": 0.1}, max_group_size=15
    )
    assert [g["name"] for g in groups] == ["dense", "ep_size_1", "ep_size_1"]
    assert [len(g["params"]) for g in groups] == [5, 2, 2]  # experts cut at 15 elements: one Linear(4, 3) each
    assert all(g["moe"] and g["lr"] == 0.1 for g in groups[1:])
    assert {id(p) for g in groups[1:] for p in g["params"]} == {id(p) for p in experts}
