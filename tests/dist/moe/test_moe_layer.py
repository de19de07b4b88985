"""The MoE layer (zeroshard/moe) at world size 4 on gloo, without the engine.

Without drops, each token's output is its gate-weighted experts' output whatever batch it
came in, so the layer on 4 ranks (token counts 5, 6, 7, 8) must equal one process running
the same experts on the concatenated batch, for ep_size 1, 2 and 4, top-1, top-2 and top-3:
the outputs, the input gradients, the gate gradient summed over ranks (each rank's gate
sees its own tokens), and each expert's gradient summed over the ranks that hold it (the
all-to-all's backward brings its expert-parallel group's tokens' gradients to it).
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.dist.scenarios.moe_layer import (
    NUM_EXPERTS,
    LayerCase,
    bad_ep_size,
    build_layer,
    layer_cases,
    rank_batch,
)

WORLD = 4
TIMEOUT_S = 300
# fp32 on both sides; the distributed run sums the same products in another order (gate
# gradient: 4 per-rank sums instead of one), a few ulp on O(1) values.
ATOL, RTOL = 1e-5, 1e-5

DROPLESS = [LayerCase(ep, k) for ep in (1, 2, 4) for k in (1, 2, 3)]
ZERO_TOKEN = [LayerCase(ep, 1, drop_tokens=drop, all_to_expert_zero=True) for ep in (2, 4) for drop in (False, True)]
UNEVEN = [LayerCase(ep, k, drop_tokens=True, uneven=True) for ep in (2, 4) for k in (1, 2, 3)]


@pytest.fixture(scope="module")
def runs(dist_pool):
    return dist_pool(WORLD).run(layer_cases, DROPLESS + ZERO_TOKEN + UNEVEN, timeout=TIMEOUT_S)


def reference(case: LayerCase) -> dict:
    """One process, ep_size 1, the concatenated batch."""
    moe = build_layer(case, ep_size=1)
    batches = [rank_batch(case, r) for r in range(WORLD)]
    x = torch.cat([b[0] for b in batches]).requires_grad_(True)
    w = torch.cat([b[1] for b in batches])
    out, _, _ = moe(x)
    (out * w).sum().backward()
    sizes = [b[0].shape[0] for b in batches]
    return {
        "out": out.detach().split(sizes), "x_grad": x.grad.split(sizes),
        "gate_grad": moe.deepspeed_moe.gate.wg.weight.grad,
        "expert_grads": {
            j: {n: p.grad for n, p in module.named_parameters()}
            for j, module in enumerate(moe.deepspeed_moe.experts.deepspeed_experts)
        },
    }


@pytest.mark.parametrize("index", range(len(DROPLESS)), ids=[c.label for c in DROPLESS])
def test_dropless_equals_one_process_on_concatenated_batch(runs, index: int) -> None:
    case = DROPLESS[index]
    ref = reference(case)
    for rank in range(WORLD):
        mine = runs[rank][index]
        torch.testing.assert_close(mine["out"], ref["out"][rank], atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(mine["x_grad"], ref["x_grad"][rank], atol=ATOL, rtol=RTOL)
        assert len(mine["expert_grads"]) == 4 // case.ep_size
        for g in mine["expert_grads"]:
            assert g // (4 // case.ep_size) == rank % case.ep_size  # global expert = ep_rank * local + j
    # An expert's gradient summed over the ranks holding it (its expert-data-parallel group,
    # the engine's reduction) is the reference's.
    for g, ref_grads in ref["expert_grads"].items():
        holders = [runs[r][index]["expert_grads"][g] for r in range(WORLD) if g in runs[r][index]["expert_grads"]]
        assert len(holders) == WORLD // case.ep_size
        for name, ref_grad in ref_grads.items():
            torch.testing.assert_close(sum(h[name] for h in holders), ref_grad, atol=ATOL, rtol=RTOL)
    gate_sum = sum(runs[r][index]["gate_grad"] for r in range(WORLD))
    torch.testing.assert_close(gate_sum, ref["gate_grad"], atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("index", range(len(DROPLESS)), ids=[c.label for c in DROPLESS])
def test_collectives_on_the_expert_parallel_group(runs, index: int) -> None:
    """ep_size 1: no collective at all. Otherwise one MAX all-reduce for the dropless capacity
    and four all-to-alls (dispatch, combine and their gradients), all on the rank's consecutive
    expert-parallel group, the same element count for every rank of the group."""
    case = DROPLESS[index]
    for rank in range(WORLD):
        mine = runs[rank][index]
        ep = tuple(range(rank - rank % case.ep_size, rank - rank % case.ep_size + case.ep_size))
        assert mine["ep_ranks"] == ep
        assert mine["edp_ranks"] == tuple(range(rank % case.ep_size, WORLD, case.ep_size))
        ops = [(op, tag, group) for op, tag, group, _ in mine["collectives"]]
        if case.ep_size == 1:
            assert ops == []
            continue
        assert sorted(ops) == sorted([
            ("all_reduce", "moe_capacity", ep), ("all_to_all", "moe_dispatch", ep),
            ("all_to_all", "moe_combine", ep), ("all_to_all", "moe_combine_grad", ep),
            ("all_to_all", "moe_dispatch_grad", ep),
        ])
        numels = {n for op, _, _, n in mine["collectives"] if op == "all_to_all"}
        assert numels == {runs[ep[0]][index]["collectives"][1][3]}


@pytest.mark.parametrize("index", range(len(ZERO_TOKEN)), ids=[c.label for c in ZERO_TOKEN])
def test_experts_without_tokens_do_not_hang(runs, index: int) -> None:
    """Every token on every rank chooses expert 0 (on rank 0 or 0 and 2): the other experts get
    no token, their ranks still exchange zero-filled slots, and their gradients are zero. A
    kept token's output is p0 * expert0(x); a dropped one's is zero."""
    case = ZERO_TOKEN[index]
    result = [runs[r][len(DROPLESS) + index] for r in range(WORLD)]
    moe = build_layer(case, ep_size=1)
    for rank in range(WORLD):
        mine = result[rank]
        assert mine["counts"].tolist() == [rank_batch(case, rank)[0].shape[0], 0, 0, 0]
        x, _ = rank_batch(case, rank)
        with torch.no_grad():
            p0 = torch.softmax(x @ moe.deepspeed_moe.gate.wg.weight.t(), dim=1)[:, 0:1]
            full = p0 * moe.deepspeed_moe.experts.deepspeed_experts[0](x)
        kept = mine["out"].abs().sum(dim=1) > 0
        expected_kept = 2 if case.drop_tokens else x.shape[0]  # capacity ceil(8 / 4)
        assert int(kept.sum()) == expected_kept
        torch.testing.assert_close(mine["out"][kept], full[kept], atol=ATOL, rtol=RTOL)
        for g, grads in mine["expert_grads"].items():
            for grad in grads.values():
                assert grad is not None
                if g != 0:
                    assert torch.count_nonzero(grad) == 0


def test_ep_size_must_divide_the_world(dist_pool) -> None:
    messages = dist_pool(WORLD).run(bad_ep_size, timeout=60)
    for message in messages:
        assert "ep_size=3: must divide the world size 4" in message


def test_all_to_all_with_split_sizes(dist_pool) -> None:
    from tests.dist.scenarios.moe_layer import uneven_all_to_all

    for rank, result in enumerate(dist_pool(WORLD).run(uneven_all_to_all, timeout=60)):
        expected = torch.cat([torch.full((rank + 1, 2), float(10 * j + rank)) for j in range(WORLD)])
        assert torch.equal(result["recv"], expected), rank
        assert result["records"] == [("all_to_all", 2 * (1 + 2 + 3 + 4), "test", (0, 1, 2, 3))]


def capacity_of(case: LayerCase, tokens: int) -> int:
    """ceil(S / E x capacity_factor 1 x k), at least min_capacity 1 (float64 formula)."""
    return max(1, math.ceil(tokens / NUM_EXPERTS * 1.0 * case.k))


@pytest.mark.parametrize("index", range(len(UNEVEN)), ids=[c.label for c in UNEVEN])
def test_uneven_token_counts_with_drops_use_the_group_capacity(runs, index: int) -> None:
    """Ranks hold 3, 7, 11 and 15 tokens with drops: every rank of an expert-parallel group
    uses the capacity of its group's largest batch (agreed by a MAX all-reduce; before, the
    all-to-all's sizes differed and gloo aborted), so each rank equals one process running its
    batch at that capacity: outputs, input gradients, and each expert's gradient summed over
    the ranks holding it."""
    case = UNEVEN[index]
    result = [runs[r][len(DROPLESS) + len(ZERO_TOKEN) + index] for r in range(WORLD)]
    expert_sums: dict[int, dict[str, torch.Tensor]] = {}
    own_capacity_differs = False  # the agreement matters: some rank would drop other routes alone
    for rank in range(WORLD):
        first = rank - rank % case.ep_size
        capacity = max(capacity_of(case, rank_batch(case, r)[0].shape[0]) for r in range(first, first + case.ep_size))
        moe = build_layer(case, ep_size=1)
        moe.deepspeed_moe.gate.min_capacity = capacity
        x, w = rank_batch(case, rank)
        x.requires_grad_(True)
        out, _, _ = moe(x)
        (out * w).sum().backward()
        torch.testing.assert_close(result[rank]["out"], out.detach(), atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(result[rank]["x_grad"], x.grad, atol=ATOL, rtol=RTOL)
        for j, module in enumerate(moe.deepspeed_moe.experts.deepspeed_experts):
            sums = expert_sums.setdefault(j, {})
            for n, p in module.named_parameters():
                sums[n] = sums.get(n, 0) + p.grad
        moe.deepspeed_moe.gate.min_capacity = 1
        with torch.no_grad():
            own_capacity_differs |= not torch.allclose(moe(x)[0], out, atol=ATOL, rtol=RTOL)
    assert own_capacity_differs
    for g, ref_grads in expert_sums.items():
        holders = [result[r]["expert_grads"][g] for r in range(WORLD) if g in result[r]["expert_grads"]]
        for name, ref_grad in ref_grads.items():
            torch.testing.assert_close(sum(h[name] for h in holders), ref_grad, atol=ATOL, rtol=RTOL)
