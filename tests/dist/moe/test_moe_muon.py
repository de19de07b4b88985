"""Muon with expert parameters (issue 17 item 3): world 2 at stages 0-3 with ep_size 1 and 2,
world 4 with ep_size 2 at stages 1 and 3.

Expert weights in both layouts (DeepSpeed's MoE Linears and AutoEP's stacked
`experts.w1/w2` [local experts, rows, cols], see tests/dist/scenarios/moe_muon.py) are sharded
over their expert-data-parallel group; Muon must orthogonalize each expert matrix on its own,
whole and fully reduced, whichever rank owns it. The routers (`gate.wg`, `router`) take AdamW.

The reference is one process in this test, written from the formulas: the model at ep_size 1
in fp32 runs every rank's micro-batches (rank r's stacked block uses experts r % ep_size),
sums the gradients / (world x accumulation), clips by the global norm, then steps in float64:
Muon (Nesterov momentum, Newton-Schulz per expert matrix, sqrt(max(1, rows/cols)), decoupled
weight decay) or AdamW (bias correction) by a rule of its own.

Tolerance: 5e-6 absolute on parameters of size ~0.4 after 2 steps (largest seen: 5.8e-7). The engine sums the same
fp32 gradients in another order (~1e-7 relative) and runs Newton-Schulz in fp32 (~5e-6 on
O's entries for ill-conditioned inputs, test_newton_schulz.py), times lr = 0.05. An expert
normalised with the wrong norm, a router stepped by Muon or a wrong lr moves a parameter by
~1e-3 or more.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch

from tests.dist.ns_reference import reference_newton_schulz
from tests.dist.scenarios.moe_muon import (
    ADAM_LR,
    BETAS,
    CLIP,
    EPS,
    GA,
    MOMENTUM,
    MUON_LR,
    NUM_EXPERTS,
    STACKED,
    STEPS,
    WD,
    MuonCase,
    build_model,
    global_names,
    micro_batch,
    train_cases,
)

WORLD = 2
PARAM_ATOL = 5e-6
CASES = [MuonCase(ep, stage, user_groups=stage % 2 == 1) for ep in (1, 2) for stage in (0, 1, 2, 3)]


def reference_is_muon(name: str, p: torch.Tensor) -> bool:
    components = set(name.split("."))
    return p.dim() >= 2 and "embed" not in name and not components & {"gate", "router"}


def reference_update(u: torch.Tensor) -> torch.Tensor:
    if u.dim() == 3:  # one expert at a time
        return torch.stack([reference_update(e) for e in u])
    return reference_newton_schulz(u) * math.sqrt(max(1.0, u.shape[0] / u.shape[1]))


@functools.cache  # read-only results, shared by the cases of one ep_size
def reference_run(ep_size: int, world: int = WORLD) -> list[dict[str, torch.Tensor]]:
    model = build_model(ep_size, 0, full_stack=True)
    params = global_names(model)
    state: dict[str, dict[str, torch.Tensor]] = {n: {} for n in params}
    history = []
    for step in range(1, STEPS + 1):
        model.zero_grad()
        for rank in range(world):
            model.stacked.first = model.stacked.offset = (rank % ep_size) * model.stacked.count
            for micro in range(GA):
                (model(*micro_batch(rank, step - 1, micro)) / (world * GA)).backward()
        grads = {n: p.grad.double() for n, p in params.items()}
        norm = torch.sqrt(sum(g.pow(2).sum() for g in grads.values()))
        if CLIP / (norm + 1e-6) < 1:
            grads = {n: g * (CLIP / (norm + 1e-6)) for n, g in grads.items()}
        with torch.no_grad():
            for n, p in params.items():
                g, s, value = grads[n], state[n], p.double()
                if reference_is_muon(n, p):
                    s["m"] = MOMENTUM * s.get("m", torch.zeros_like(g)) + (1 - MOMENTUM) * g
                    u = (1 - MOMENTUM) * g + MOMENTUM * s["m"]
                    value = value * (1 - MUON_LR * WD) - MUON_LR * reference_update(u)
                else:
                    s["m1"] = BETAS[0] * s.get("m1", torch.zeros_like(g)) + (1 - BETAS[0]) * g
                    s["v"] = BETAS[1] * s.get("v", torch.zeros_like(g)) + (1 - BETAS[1]) * g * g
                    m_hat, v_hat = s["m1"] / (1 - BETAS[0] ** step), s["v"] / (1 - BETAS[1] ** step)
                    value = value * (1 - ADAM_LR * WD) - ADAM_LR * m_hat / (v_hat.sqrt() + EPS)
                p.copy_(value)
                s["value"] = value  # the float64 result, before rounding to the fp32 parameter
        history.append({n: state[n]["value"].clone() for n in params})
    return history


@pytest.fixture(scope="module")
def runs(dist_pool):
    return dist_pool(WORLD).run(train_cases, CASES, timeout=600)


def check_against_reference(per_rank: list, case: MuonCase, world: int) -> None:
    reference = reference_run(case.ep_size, world)
    local = NUM_EXPERTS // case.ep_size
    for rank in range(world):
        result = per_rank[rank]
        assert result["optimizer"] == "ShardedMuon"
        first = result["first"]
        assert first == (rank % case.ep_size) * local
        for step in range(STEPS):
            for name, value in result["masters"][step].items():
                want = reference[step][name]
                if name in STACKED:
                    want = want[first : first + local]
                torch.testing.assert_close(
                    value.double(), want, rtol=0, atol=PARAM_ATOL,
                    msg=lambda m, n=name, s=step, r=rank: f"{case.label} W={world} rank {r} step {s + 1} {n}: {m}",
                )


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.label)
def test_moe_muon_equals_reference_after_two_steps(runs, case):
    check_against_reference([runs[rank][CASES.index(case)] for rank in range(WORLD)], case, WORLD)


def test_local_expert_stacks_sharded_over_two_ranks_at_world_four(dist_pool):
    """World 4, ep_size 2: each rank holds 2 of the 4 experts and shares them with one other
    rank (expert-data-parallel group of 2), so at stages 1-3 the local stacks are split
    between two shards and their slices owned by either rank."""
    cases = [MuonCase(2, stage, user_groups=stage == 3) for stage in (1, 3)]
    per_rank = dist_pool(4).run(train_cases, cases, timeout=600)
    for index, case in enumerate(cases):
        results = [per_rank[rank][index] for rank in range(4)]
        assert {r["edp"] for r in results} == {2}
        check_against_reference(results, case, 4)
        for r in results:
            assert len({r["owners"][f"{n}[{e}]"] for n in STACKED for e in range(2)}) == 2, r["owners"]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.label)
def test_moe_groups_have_the_right_kind_and_lr(runs, case):
    """Expert parameters sit in "moe" groups of their own (from the config or from
    split_params_into_different_moe_groups_for_optimizer), each split into a Muon part at
    muon_lr and an AdamW part at adam_lr; the routers are in the AdamW parts."""
    index = CASES.index(case)
    model = build_model(case.ep_size, 0, full_stack=True)
    for rank in range(WORLD):
        groups = runs[rank][index]["groups"]
        for name, p in global_names(model).items():
            if ".deepspeed_experts." in name:
                expert = int(name.split(".deepspeed_experts.")[1].split(".")[0])
                if expert // (NUM_EXPERTS // case.ep_size) != rank % case.ep_size:
                    continue  # another rank's expert
            use_muon, lr, moe = groups[name]
            assert use_muon == reference_is_muon(name, p), f"{case.label} {name}: use_muon={use_muon}"
            assert lr == (MUON_LR if use_muon else ADAM_LR), f"{case.label} {name}: lr={lr}"
            assert moe == (".deepspeed_experts." in name or name in STACKED), f"{case.label} {name}: moe={moe}"
        assert not groups["moe.deepspeed_moe.gate.wg.weight"][0] and not groups["stacked.router.weight"][0]
        assert groups["stacked.experts.w1"][0] and groups["head.weight"][0]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.label)
def test_stacked_experts_are_owned_per_expert_slice(runs, case):
    """Each expert matrix of a stacked weight is its own Newton-Schulz task with one owner in
    the expert-data-parallel group (the same assignment on every rank of it); with two ranks
    there (ep_size 1 here) the slices are spread over both."""
    local = NUM_EXPERTS // case.ep_size
    per_rank = [runs[rank][CASES.index(case)] for rank in range(WORLD)]
    for rank, result in enumerate(per_rank):
        owners = result["owners"]
        assert result["edp"] == WORLD // case.ep_size
        for name in STACKED:
            assert name not in owners, f"{case.label}: {name} owned as one matrix"
            slices = {e: owners[f"{name}[{e}]"] for e in range(local)}
            assert set(slices.values()) <= set(range(result["edp"])), f"{case.label} {name}: {slices}"
            if result["edp"] > 1:
                assert len(set(slices.values())) == result["edp"], f"{case.label} {name}: {slices}"
        if case.ep_size == 1:
            assert owners == per_rank[0]["owners"], f"{case.label}: rank {rank} assigns other owners"
