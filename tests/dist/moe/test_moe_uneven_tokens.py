"""MoE ranks holding different numbers of tokens (world 2, ep_size 2, drops at capacity factor 1).

Each rank computes its capacity from its own token count, but the all-to-all exchanges
E x C slots with every rank, so the router agrees C by a MAX all-reduce: every rank uses the
capacity of the rank holding the most tokens. (Before, ranks with 16 and 40 tokens died with
SIGABRT inside gloo.) The result must equal one process holding every expert, run on each
rank's batch at that capacity: the reference below sets the one-process gates' min_capacity
to ceil(max tokens / E * capacity_factor * k), the formula in float64, so its capacity is the
agreed one whatever its own batch.

Training: dynamic padding (2 x 8 = 16 tokens against 2 x 20 = 40, either way round, once
equal), 3 steps of 2 micro-steps, AdamW with clipping, at stages 2 and 3; the reference is
plain torch (ep_size 1, the gradient of sum over ranks and micro-steps of loss / (world x
accumulation), clip_grad_norm_, torch.optim.AdamW). Evaluation: a smaller last batch on
rank 1 (14 tokens against 40).
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.dist.scenarios.moe_uneven import (
    BATCH,
    CLIP,
    EVAL_SEQ,
    GA,
    LR,
    NUM_EXPERTS,
    SEQ_LENGTHS,
    STEPS,
    K,
    build_model,
    eval_batch,
    global_names,
    train_batch,
    train_uneven,
)

WORLD = 2
STAGES = (2, 3)
TIMEOUT_S = 600
# fp32 on both sides. The distributed run sums the same products in another order (an expert's
# gradient: its rank's autograd sum over both ranks' tokens, against one process's sum over
# each rank's batch in turn; the engine divides by world x accumulation after reducing, the
# reference before summing), a few ulp of O(1) gradients; AdamW's first steps move each weight
# by about lr x sign(gradient), so after 3 steps a difference stays at the gradients' rounding
# level unless a gradient element is ~0 (none is here: the largest gap observed is 6e-8).
FP32 = {"atol": 1e-5, "rtol": 1e-5}


def agreed_capacity(tokens: list[int]) -> int:
    """Top-2 capacity of the rank with the most tokens: ceil(S / E x capacity_factor 1 x k)."""
    return max(2, math.ceil(max(tokens) / NUM_EXPERTS * 1.0 * K))


def set_capacity(model, capacity: int) -> None:
    for moe in model.moe:
        moe.deepspeed_moe.gate.min_capacity = capacity


def reference_training():
    model = build_model(ep_size=1)
    params = global_names(model)
    optimizer = torch.optim.AdamW(params.values(), lr=LR, weight_decay=0.0)
    masters = []
    for step in range(STEPS):
        optimizer.zero_grad()
        for micro in range(GA):
            set_capacity(model, agreed_capacity([BATCH * s for s in SEQ_LENGTHS[step][micro]]))
            for rank in range(WORLD):
                (model(*train_batch(rank, step, micro)) / (WORLD * GA)).backward()
        torch.nn.utils.clip_grad_norm_(list(params.values()), CLIP)
        optimizer.step()
        masters.append({n: p.detach().clone() for n, p in params.items()})
    return masters, model


@pytest.fixture(scope="module")
def runs(dist_pool):
    return dist_pool(WORLD).run(train_uneven, list(STAGES), timeout=TIMEOUT_S)


@pytest.fixture(scope="module")
def reference():
    return reference_training()


@pytest.mark.parametrize("stage", STAGES)
def test_dynamic_padding_trains_as_one_process_at_the_agreed_capacity(runs, reference, stage) -> None:
    ref_masters, _ = reference
    i = STAGES.index(stage)
    for step in range(STEPS):
        mine: dict[str, torch.Tensor] = {}  # each rank holds the dense weights and its own experts
        for rank in range(WORLD):
            for name, value in runs[rank][i]["masters"][step].items():
                if name in mine:
                    torch.testing.assert_close(value, mine[name], atol=0, rtol=0, msg=f"{name} differs between ranks")
                mine[name] = value
        assert set(mine) == set(ref_masters[step])
        for name, value in ref_masters[step].items():
            torch.testing.assert_close(
                mine[name], value, **FP32, msg=lambda m, n=name, s=step: f"step {s + 1} {n}: {m}"
            )


@pytest.mark.parametrize("stage", STAGES)
def test_all_to_all_buffers_are_sized_by_the_agreed_capacity(runs, stage) -> None:
    """16 tokens against 40: both ranks exchange E x 20 x M slots (40 tokens' capacity), after
    one MAX all-reduce per layer."""
    capacity = agreed_capacity([BATCH * s for s in SEQ_LENGTHS[0][0]])
    assert capacity == 20
    for rank in range(WORLD):
        records = runs[rank][STAGES.index(stage)]["first_forward"]
        assert [op for op, _, _ in records].count("all_reduce") == 2  # one moe_capacity per layer
        sizes = {numel for op, _, numel in records if op == "all_to_all"}
        assert sizes == {NUM_EXPERTS * capacity * 8}, records


@pytest.mark.parametrize("stage", STAGES)
def test_smaller_last_batch_evaluates_as_one_process(runs, reference, stage) -> None:
    """Evaluation after training: each rank's loss equals the reference model's (the trained
    one-process model) on that rank's batch at the agreed capacity. At its own capacity the
    smaller batch drops routes, and its loss differs: the agreement is what is tested."""
    _, model = reference
    model.eval()
    tokens = [BATCH * s for s in EVAL_SEQ]
    with torch.no_grad():
        set_capacity(model, agreed_capacity(tokens))
        expected = [model(*eval_batch(rank)).item() for rank in range(WORLD)]
        set_capacity(model, 2)
        own_capacity = model(*eval_batch(1)).item()
    assert abs(own_capacity - expected[1]) > 1e-4
    for rank in range(WORLD):
        assert runs[rank][STAGES.index(stage)]["eval_loss"] == pytest.approx(expected[rank], rel=1e-5, abs=1e-6)
