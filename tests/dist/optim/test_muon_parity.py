"""One parity matrix for Muon (issue 26 item 4; folds in issue 17's MoE Muon test): whole and
per-head, with and without QK-clip, at ZeRO stages 0-3 x expert parallel 1 and 2 x gradient accumulation 1 and 4
x optimizer offload off and on x world 2 and 4, every case equal to one process running Muon
on the same global batches.

The model (tests/dist/scenarios/moe_muon.py) has every kind of weight Muon must tell apart:
expert weights in both layouts (DeepSpeed's MoE Linears and AutoEP's stacked `experts.w1/w2`
[local experts, rows, cols]) sharded over their expert-data-parallel group, routers (AdamW),
and a grouped-query attention block whose biased query projection QK-clip rescales.

The cases. Stage (4 levels) x expert parallel x accumulation x offload x QK-clip is covered
by an orthogonal array of 8 runs per world size: every stage meets every ep_size, and every
pair of levels of any two of the five dimensions occurs (strength 2); world 2 and world 4 use
different arrays, so no two cases repeat a combination. Per-head Muon (query/key/value rows
and the output's columns per head, through the parameter attributes) rides on the stage
column (see `_orthogonal_array`). Offload needs stage 1 or more (as in
DeepSpeed), so the one stage-0 row per array that asks for it runs without; every pair with
offload on still occurs in another row. Gradient clipping (by the global
norm, 0.5: below the gradient norm, so it acts) is on in every case.

The reference is one process, written from the formulas (tests/dist/muon_reference.py): the
model at ep_size 1 in float64 runs every rank's micro-batches (rank r's stacked block uses
experts r % ep_size), sums the gradients / (world x accumulation), clips by the global norm,
steps (Muon: Nesterov momentum, Newton-Schulz per expert matrix, sqrt(max(1, rows/cols)),
decoupled weight decay; AdamW with bias correction), then QK-clip: S_max per head from its
own full logit matrices over every forward of the step, the grouped-query rescale.

Tolerance: 5e-6 absolute on parameters of size ~0.4 after 2 steps. The engine sums the same
fp32 gradients in another order (~1e-7 relative) and runs Newton-Schulz in fp32 (~5e-6 on
O's entries for ill-conditioned inputs, test_newton_schulz.py), times lr = 0.05; QK-clip's
factors carry S_max's fp32 error (~1e-7 relative). An expert normalised with the wrong norm,
a router stepped by Muon, a wrong lr, a lost micro-batch or a misattributed head moves a
parameter by ~1e-3 or more.

Newton-Schulz count: summed over the ranks, the matrices orthogonalized in one optimizer step
equal the model's Muon matrices (each expert of a stack counts one), whatever the
accumulation: the orthogonalization runs once per step on the reduced gradient, never per
micro-batch.
"""

from __future__ import annotations

import functools

import pytest
import torch

from tests.dist import muon_reference as ref
from tests.dist.scenarios.moe_muon import (
    ADAM_LR,
    ALPHA,
    BETAS,
    EPS,
    HEADS,
    KV_HEADS,
    MOMENTUM,
    MUON_LR,
    NUM_EXPERTS,
    STACKED,
    STEPS,
    TAU,
    WD,
    MuonCase,
    build_model,
    global_names,
    micro_batch,
    train_cases,
)

PARAM_ATOL = 5e-6
# Per-head Muon's blocks (count, axis): query/key/value rows per head, the output's columns.
HEAD_BLOCKS = {"attn.wq.weight": (HEADS, 0), "attn.wk.weight": (KV_HEADS, 0), "attn.wv.weight": (KV_HEADS, 0),
               "attn.wo.weight": (HEADS, 1)}
HP = {"muon_lr": MUON_LR, "adam_lr": ADAM_LR, "momentum": MOMENTUM, "weight_decay": WD, "betas": BETAS, "eps": EPS}


def _orthogonal_array(flip: int) -> list[tuple[int, int, int, int, int, int]]:
    """(stage, ep_size, ga, offload, qk_clip, per_head): stage = 2a + b, ep from c, the rest from
    a^c, b^c and a^b^c (L8's columns), `flip` permuting which of them drives which dimension.
    Per-head is a^b (flip 0) or its negation (flip 1): a function of the stage, so over both
    worlds every stage runs both ways, and it meets every level of the other four."""
    rows = []
    for stage in range(4):
        a, b = stage >> 1, stage & 1
        for c in (0, 1):
            x, y, z = a ^ c, b ^ c, a ^ b ^ c
            ga, offload, qk = (x, y, z) if not flip else (z, x, y)
            per_head = (a ^ b) ^ flip
            rows.append((stage, 1 + c, 4 if ga else 1, offload and stage > 0, qk, per_head))  # offload needs stage >= 1
    return rows


CASES = {
    world: [MuonCase(ep, stage, user_groups=stage % 2 == 1, ga=ga, offload=bool(off), qk_clip=bool(qk),
                     per_head=bool(ph))
            for stage, ep, ga, off, qk, ph in _orthogonal_array(flip)]
    for world, flip in ((2, 0), (4, 1))
}
# The first world-2 row again without gradient clipping (test_gradient_clipping_*).
CASES[2].append(MuonCase(1, 0, ga=1, clip=0.0))


@functools.cache  # read-only results, shared by the cases with the same reference
def reference_run(ep_size: int, world: int, ga: int, qk_clip: bool, clip: float,
                  per_head: bool = False) -> tuple[list[dict], list]:
    model = build_model(ep_size, 0, full_stack=True).double()
    params = global_names(model)
    values = {n: p.detach().clone() for n, p in params.items()}
    state: dict = {}
    history, s_hist = [], []
    for step in range(1, STEPS + 1):
        model.zero_grad()
        model.attn.probe = []
        for rank in range(world):
            model.stacked.first = model.stacked.offset = (rank % ep_size) * model.stacked.count
            for micro in range(ga):
                x, y = micro_batch(rank, step - 1, micro)
                (model(x.double(), y.double()) / (world * ga)).backward()
        s_max = torch.stack(model.attn.probe).amax(0)
        grads = ref.clip_grads({n: p.grad for n, p in params.items()}, clip)
        ref.muon_step(values, grads, state, step, HP, blocks=HEAD_BLOCKS if per_head else None)
        if qk_clip:
            values["attn.wq.weight"], values["attn.wk.weight"] = ref.gqa_clip(
                values["attn.wq.weight"], values["attn.wk.weight"], ref.gamma_of(s_max, TAU), KV_HEADS, ALPHA)
            values["attn.wq.bias"], _ = ref.gqa_clip(
                values["attn.wq.bias"], values["attn.wk.weight"], ref.gamma_of(s_max, TAU), KV_HEADS, ALPHA)
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(values[n])
        history.append({n: v.clone() for n, v in values.items()})
        s_hist.append(s_max)
    return history, s_hist


def muon_matrix_count(per_head: bool) -> int:
    """The model's Muon matrices at full size, each expert of a stack and (per head) each head
    block counted once."""
    model = build_model(1, 0, full_stack=True)
    blocks = HEAD_BLOCKS if per_head else {}
    return sum(p.shape[0] if p.dim() == 3 else blocks.get(n, (1, 0))[0]
               for n, p in global_names(model).items() if ref.is_muon(n, p))


@pytest.fixture(scope="module")
def runs(dist_pool):
    return {world: dist_pool(world).run(train_cases, cases, timeout=600) for world, cases in CASES.items()}


def check_against_reference(per_rank: list, case: MuonCase, world: int) -> None:
    reference, s_hist = reference_run(case.ep_size, world, case.ga, case.qk_clip, case.clip, case.per_head)
    if case.qk_clip:
        assert any((s > TAU).any() and (s <= TAU).any() for s in s_hist), f"{case.label}: want heads on both sides"
    local = NUM_EXPERTS // case.ep_size
    for rank in range(world):
        result = per_rank[rank]
        assert result["optimizer"] == "ShardedMuon"
        first = result["first"]
        assert first == (rank % case.ep_size) * local
        for step in range(STEPS):
            if case.qk_clip:
                torch.testing.assert_close(result["s_max"][step].double(), s_hist[step], rtol=1e-5, atol=0)
            for name, value in result["masters"][step].items():
                want = reference[step][name]
                if name in STACKED:
                    want = want[first : first + local]
                torch.testing.assert_close(
                    value.double(), want, rtol=0, atol=PARAM_ATOL,
                    msg=lambda m, n=name, s=step, r=rank: f"{case.label} W={world} rank {r} step {s + 1} {n}: {m}",
                )


ALL = [(world, case) for world, cases in CASES.items() for case in cases]


@pytest.mark.parametrize("world, case", ALL, ids=[f"W{w}-{c.label}" for w, c in ALL])
def test_muon_equals_one_process_reference(runs, world, case):
    check_against_reference([runs[world][rank][CASES[world].index(case)] for rank in range(world)], case, world)


@pytest.mark.parametrize("world, case", ALL, ids=[f"W{w}-{c.label}" for w, c in ALL])
def test_newton_schulz_runs_once_per_matrix_per_step(runs, world, case):
    want = muon_matrix_count(case.per_head)
    for step in range(STEPS):
        total = sum(runs[world][rank][CASES[world].index(case)]["ns_matrices"][step] for rank in range(world))
        assert total == want, f"W={world} {case.label} step {step + 1}: {total} matrices orthogonalized, want {want}"


def test_gradient_clipping_rescales_muons_input_not_its_update(runs):
    """Clipping multiplies the reduced gradient by c = clip / norm before the optimizer; Muon's
    Newton-Schulz normalises its input, so a step whose u is one scaled gradient (the first:
    u = (1 - beta) c g) is the unclipped step. Later, m holds earlier gradients at their own
    c, so clipping re-weights the momentum: the update differs (and matches the reference,
    which clips the same way; docs/muon.md "Gradient clipping"). Tolerance 4 x PARAM_ATOL at
    step 1: Newton-Schulz divides by the norm + 1e-7, so the 0.01-scale expert's clipped
    gradient (norm ~1e-4) is scale-invariant only to ~1e-3 relative (6e-6 seen)."""
    clipped, plain = (CASES[2].index(c) for c in (MuonCase(1, 0, ga=1), MuonCase(1, 0, ga=1, clip=0.0)))
    model = build_model(1, 0, full_stack=True)
    muon = [n for n, p in global_names(model).items() if ref.is_muon(n, p)]
    first, second = (
        [(runs[2][0][i]["masters"][step]) for i in (clipped, plain)] for step in (0, 1)
    )
    for name in muon:
        torch.testing.assert_close(first[0][name], first[1][name], rtol=0, atol=4 * PARAM_ATOL,
                                   msg=lambda m, n=name: f"step 1 {n}: clipping changed Muon's update: {m}")
    gaps = {n: (second[0][n] - second[1][n]).abs().max().item() for n in muon}
    assert max(gaps.values()) > 100 * PARAM_ATOL, f"step 2: clipping left the momentum's weights alone: {gaps}"


def test_local_expert_stacks_sharded_over_two_ranks_at_world_four(runs):
    """World 4, ep_size 2: each rank holds 2 of the 4 experts and shares them with one other
    rank (expert-data-parallel group of 2), so at stages 1-3 the local stacks are split
    between two shards and their slices owned by either rank."""
    for index, case in enumerate(CASES[4]):
        if case.ep_size != 2 or case.stage == 0:
            continue
        results = [runs[4][rank][index] for rank in range(4)]
        assert {r["edp"] for r in results} == {2}
        for r in results:
            assert len({r["owners"][f"{n}[{e}]"] for n in STACKED for e in range(2)}) == 2, r["owners"]


@pytest.mark.parametrize("case", CASES[2], ids=lambda c: c.label)
def test_moe_groups_have_the_right_kind_and_lr(runs, case):
    """Expert parameters sit in "moe" groups of their own (from the config or from
    split_params_into_different_moe_groups_for_optimizer), each split into a Muon part at
    muon_lr and an AdamW part at adam_lr; the routers are in the AdamW parts."""
    index = CASES[2].index(case)
    model = build_model(case.ep_size, 0, full_stack=True)
    for rank in range(2):
        groups = runs[2][rank][index]["groups"]
        for name, p in global_names(model).items():
            if ".deepspeed_experts." in name:
                expert = int(name.split(".deepspeed_experts.")[1].split(".")[0])
                if expert // (NUM_EXPERTS // case.ep_size) != rank % case.ep_size:
                    continue  # another rank's expert
            use_muon, lr, moe = groups[name]
            assert use_muon == ref.is_muon(name, p), f"{case.label} {name}: use_muon={use_muon}"
            assert lr == (MUON_LR if use_muon else ADAM_LR), f"{case.label} {name}: lr={lr}"
            assert moe == (".deepspeed_experts." in name or name in STACKED), f"{case.label} {name}: moe={moe}"
        assert not groups["moe.deepspeed_moe.gate.wg.weight"][0] and not groups["stacked.router.weight"][0]
        assert groups["stacked.experts.w1"][0] and groups["head.weight"][0]


@pytest.mark.parametrize("case", CASES[2], ids=lambda c: c.label)
def test_stacked_experts_are_owned_per_expert_slice(runs, case):
    """Each expert matrix of a stacked weight is its own Newton-Schulz task with one owner in
    the expert-data-parallel group (the same assignment on every rank of it); with two ranks
    there (ep_size 1 here) the slices are spread over both."""
    local = NUM_EXPERTS // case.ep_size
    per_rank = [runs[2][rank][CASES[2].index(case)] for rank in range(2)]
    for rank, result in enumerate(per_rank):
        owners = result["owners"]
        assert result["edp"] == 2 // case.ep_size
        for name in STACKED:
            assert name not in owners, f"{case.label}: {name} owned as one matrix"
            slices = {e: owners[f"{name}[{e}]"] for e in range(local)}
            assert set(slices.values()) <= set(range(result["edp"])), f"{case.label} {name}: {slices}"
            if result["edp"] > 1:
                assert len(set(slices.values())) == result["edp"], f"{case.label} {name}: {slices}"
        if case.ep_size == 1:
            assert owners == per_rank[0]["owners"], f"{case.label}: rank {rank} assigns other owners"
