"""Ulysses attention (zeroshard/sequence/layer.py) on gloo, world sizes 2 and 4.

The all-to-all must move every element to the right place (checked element by element against
the tensor rebuilt from every rank's input) and the inverse must undo it exactly.
`DistributedAttention` around causal SDPA must equal single-process attention on the whole
sequence: the output and the query, key and value gradients, with heads that do not divide
the ranks, grouped-query attention with fewer key/value heads than ranks, both layouts, and
sequence groups that are part of the world (2 data x 2 sequence), and with an `sp_stream`
(on CPU the query, key and value all-to-alls are issued asynchronously together whether or
not one is given; the stream object itself must not be touched).
"""

from __future__ import annotations

import pytest
import torch

from tests.dist.scenarios.sequence_layer import AttentionCase, attention, deepspeed_exchange, refusals, round_trip

TIMEOUT_S = 300
# fp32: the distributed run computes each head's attention on the same numbers as the
# reference; only how heads are batched into the kernel differs, which may change the blocking
# of its reductions. Gradients of k/v shared by several query heads are summed in another order.
ATOL, RTOL = 1e-6, 1e-5

ROUND_TRIP = {
    2: [(4, 0, None), (4, 1, None), (5, 0, None), (3, 1, None)],
    4: [(4, 0, None), (6, 0, None), (7, 1, None), (5, 0, 2), (3, 1, 2)],
}

ATTENTION = {
    2: [
        AttentionCase(4, 4),
        AttentionCase(4, 4, batch_dim_idx=1),
        AttentionCase(5, 5),  # uneven heads: 3 + 2
        AttentionCase(3, 3, batch_dim_idx=1, torch_group=True),
        AttentionCase(4, 2),  # GQA, kv heads = ranks
        AttentionCase(4, 1),  # MQA
        AttentionCase(4, 4, rotary=True),
        AttentionCase(4, 2, batch_dim_idx=1, rotary=True),
        AttentionCase(5, 5, sp_stream=True),
        AttentionCase(4, 1, batch_dim_idx=1, sp_stream=True, rotary=True),
        AttentionCase(6, 3),  # DeepSpeed's split by key/value group: 4 + 2 query, 2 + 1 key/value heads
        AttentionCase(7, 7, batch_dim_idx=1),  # 4 + 3
    ],
    4: [
        AttentionCase(8, 8),
        AttentionCase(6, 6),  # uneven: 2 2 1 1
        AttentionCase(7, 7, batch_dim_idx=1),
        AttentionCase(8, 2),  # GQA, fewer kv heads than ranks
        AttentionCase(8, 1, torch_group=True),
        AttentionCase(6, 3),  # uneven GQA
        AttentionCase(6, 2, batch_dim_idx=1),
        AttentionCase(4, 2, sp=2),  # 2 data x 2 sequence
        AttentionCase(5, 5, sp=2, torch_group=True, rotary=True),
        AttentionCase(6, 3, sp_stream=True),
        AttentionCase(4, 2, sp=2, batch_dim_idx=1, sp_stream=True),
    ],
}


@pytest.mark.parametrize("world", [2, 4])
def test_round_trip_is_the_identity(dist_pool, world: int) -> None:
    runs = dist_pool(world).run(round_trip, ROUND_TRIP[world], timeout=TIMEOUT_S)
    for rank, results in enumerate(runs):
        for case, result in zip(ROUND_TRIP[world], results, strict=True):
            label = f"rank {rank}: (heads, batch_dim_idx, sp) = {case}"
            assert result["gathered"].shape == result["expected"].shape, label
            mismatched = (result["gathered"] != result["expected"]).sum().item()
            assert mismatched == 0, f"{label}: {mismatched} elements misplaced by the all-to-all"
            assert torch.equal(result["back"], result["input"]), f"{label}: the inverse did not restore the input"


@pytest.mark.parametrize("world", [2, 4])
def test_distributed_attention_equals_full_attention(dist_pool, world: int) -> None:
    runs = dist_pool(world).run(attention, ATTENTION[world], timeout=TIMEOUT_S)
    for rank, results in enumerate(runs):
        for case, result in zip(ATTENTION[world], results, strict=True):
            label = f"rank {rank}: {case.label}"
            torch.testing.assert_close(
                result["out"], result["ref_out"], atol=ATOL, rtol=RTOL, msg=lambda m, s=label: f"{s}: output: {m}"
            )
            for name, mine, ref in zip("qkv", result["grads"], result["ref_grads"], strict=True):
                torch.testing.assert_close(
                    mine, ref, atol=ATOL, rtol=RTOL, msg=lambda m, n=name, s=label: f"{s}: d{n}: {m}"
                )


def test_refusals(dist_pool) -> None:
    for messages in dist_pool(2).run(refusals, timeout=TIMEOUT_S):
        assert "1 attention heads cannot be split over 2 sequence-parallel ranks" in messages[0], messages
        assert "num_kv_heads=3, but key has 1 heads" in messages[1], messages
        assert "batch_dim_idx=2: must be 0" in messages[2], messages


# DeepSpeed 0.19.8's split over 2 ranks: by key/value group (one group per head without a count).
DEEPSPEED_SPLIT = {"3 heads": [2, 1], "7 heads": [4, 3], "6 over kv 3": [4, 2]}


def test_deepspeed_low_level_exchange_with_uneven_heads(dist_pool) -> None:
    """`_SeqAllToAll.apply(..., num_kv_heads)`, `single_all_to_all` and `uneven_heads_all2all`
    (DeepSpeed's names and arguments) with 3 and 7 heads, and 6 query heads split by 3 key/value
    groups, on 2 ranks: each rank gets DeepSpeed's share of the heads over the whole sequence,
    element for element; the gather back from the uneven local heads gives the input (before:
    "the ranks hold different shapes"); gradients come back through both exchanges. And
    DistributedAttention's local attention sees 4 + 2 query and 2 + 1 key/value heads."""
    runs = dist_pool(2).run(deepspeed_exchange, timeout=TIMEOUT_S)
    for rank, out in enumerate(runs):
        for label, counts in DEEPSPEED_SPLIT.items():
            got = out[label]
            first = sum(counts[:rank])
            expected = got["full"][:, :, first : first + counts[rank]]
            assert torch.equal(got["gathered"], expected), (rank, label)
            assert got["back_is_input"] and got["single"] and got["uneven"] and got["grad_ones"], (rank, label, got)
        assert out["attention_heads"] == [(4, 2), (2, 1)][rank], (rank, out["attention_heads"])
