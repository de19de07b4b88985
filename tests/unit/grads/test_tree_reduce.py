"""The arithmetic of the deterministic reduction (zeroshard/grads/tree_reduce.py), in one process.

The claim the mode rests on: for N micro-batch gradients, the ranks' level (an ordered sum of the
W values of one micro-step, `pairwise_sum_rows`) followed by the steps' level (a binary counter
over the GAS micro-step sums, `PairwiseStack`) performs the additions of one tree over all N,
whatever the split N = W x GAS with W a power of two (or GAS = 1). Checked against the tree
written out from its definition (`tree`, independent of the code), with values whose sums round
differently in almost any other order (wide exponents), so an order change shows in the bits.
"""

from __future__ import annotations

import pytest
import torch

from zeroshard.grads.tree_reduce import (
    NORM_BLOCK_NUMEL,
    PairwiseStack,
    block_square_sums,
    pairwise_sum,
    pairwise_sum_rows,
)

COLUMNS = 257


def tree(values: list[torch.Tensor]) -> torch.Tensor:
    """Adjacent pairs summed, an odd last value carried up, until one is left."""
    while len(values) > 1:
        pairs = [values[i] + values[i + 1] for i in range(0, len(values) - 1, 2)]
        values = pairs + values[len(values) - len(values) % 2 :]
    return values[0]


def leaves(n: int, seed: int = 0) -> torch.Tensor:
    """n rows of fp32 values spread over 2^-20 .. 2^20, so sums round in an order-dependent way."""
    gen = torch.Generator().manual_seed(seed)
    scale = torch.exp2(torch.randint(-20, 21, (n, COLUMNS), generator=gen).float())
    return torch.randn(n, COLUMNS, generator=gen) * scale


def split_sum(values: torch.Tensor, world: int) -> torch.Tensor:
    """What the reducer computes for N = world x steps leaves: micro-batch k = j*world + r on rank
    r at micro-step j; each micro-step's world values summed in order, then the steps stacked."""
    stack = PairwiseStack()
    for j in range(values.shape[0] // world):
        stack.push(pairwise_sum_rows(values[j * world : (j + 1) * world].clone()))
    return stack.total()


@pytest.mark.parametrize("n", range(1, 41))
def test_rows_and_stack_are_the_tree(n: int) -> None:
    values = leaves(n, seed=n)
    expected = tree(list(values))
    assert torch.equal(pairwise_sum_rows(values.clone()), expected)
    stack = PairwiseStack()
    for row in values:
        stack.push(row.clone())
    assert stack.count == n
    assert torch.equal(stack.total(), expected)
    assert stack.count == 0  # total() starts the next accumulation
    column = values[:, 0].contiguous()
    assert torch.equal(pairwise_sum(column), tree(list(column)))  # padded to a power of two: the same tree


@pytest.mark.parametrize("total", [8, 12, 24, 64])
def test_every_power_of_two_split_is_the_same_tree(total: int) -> None:
    values = leaves(total, seed=total)
    expected = tree(list(values))
    worlds = [w for w in (1, 2, 4, 8, 16, 32, 64) if total % w == 0] + [total]
    for world in worlds:
        assert torch.equal(split_sum(values, world), expected), f"N={total}: W={world}"


def test_a_split_over_three_ranks_is_another_tree() -> None:
    """Why the config refuses W = 3 with accumulation: 3 ranks x 2 steps pair (0+1)+2 with (3+4)+5,
    the tree over 6 pairs (0+1)+(2+3) first."""
    values = leaves(6, seed=6)
    assert not torch.equal(split_sum(values, 3), tree(list(values)))
    assert torch.equal(split_sum(values, 6), tree(list(values)))  # no accumulation: fine


def test_sequential_accumulation_is_another_tree() -> None:
    """The default reduction's order at W = 2 (each rank sums its micro-steps, then the ranks) is
    not W = 1's: the reason the mode exists."""
    values = leaves(8, seed=8)
    per_rank = [values[r::2][0] for r in range(2)]
    for r in range(2):
        for row in values[r::2][1:]:
            per_rank[r] = per_rank[r] + row
    assert not torch.equal(per_rank[0] + per_rank[1], tree(list(values)))


def test_trailing_zeros_change_no_pairwise_sum() -> None:
    """The norm's blocks of padding are zeros at the end of a flat's slots, more of them at a
    larger world size: the tree's result must not move."""
    values = leaves(1, seed=3)[0][:37]
    expected = pairwise_sum(values)
    for zeros in (1, 2, 3, 27, 91):
        assert torch.equal(pairwise_sum(torch.cat([values, torch.zeros(zeros)])), expected)
    assert torch.equal(pairwise_sum(torch.zeros(0)), torch.zeros(()))


def test_block_square_sums_against_float64() -> None:
    gen = torch.Generator().manual_seed(1)
    shard = torch.randn(3 * NORM_BLOCK_NUMEL, generator=gen)
    got = block_square_sums(shard)
    want = shard.double().reshape(3, -1).pow(2).sum(1)
    # 12 levels of fp32 additions of positive terms: relative error below 12 x 2^-24 ~ 7e-7.
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=0)
    assert got.dtype == torch.float32


def test_block_sums_do_not_depend_on_where_the_shards_are_cut() -> None:
    """A flat of 16 blocks cut into 1, 2, 4, 8 or 16 shards (bf16 too: squared in fp32)."""
    gen = torch.Generator().manual_seed(2)
    flat = torch.randn(16 * NORM_BLOCK_NUMEL, generator=gen) * torch.exp2(
        torch.randint(-10, 11, (16 * NORM_BLOCK_NUMEL,), generator=gen).float()
    )
    for dtype in (torch.float32, torch.bfloat16):
        whole = block_square_sums(flat.to(dtype))
        for shards in (2, 4, 8, 16):
            pieces = [block_square_sums(piece) for piece in flat.to(dtype).chunk(shards)]
            assert torch.equal(torch.cat(pieces), whole), f"{dtype}, {shards} shards"
