"""`all_gather_shards` on a group of one: bucketing cuts and reassembles pieces exactly."""

from __future__ import annotations

import torch

from zeroshard.comm import collectives as comm
from zeroshard.sharding.gather import GatherPiece, all_gather_shards


def test_pieces_cut_across_buckets_are_reassembled_and_cast() -> None:
    group = comm.self_group(comm.world_group())
    sources = [torch.arange(7, dtype=torch.float32) + 0.25, torch.arange(3, dtype=torch.float32) * -1.5]
    targets = [torch.full((7,), float("nan"), dtype=torch.bfloat16), torch.full((3,), float("nan"))]
    pieces = [GatherPiece(s, t) for s, t in zip(sources, targets, strict=True)]
    all_gather_shards(pieces, group=group, tag="t", wire_dtype=torch.bfloat16, bucket_numel=4).wait()
    assert torch.equal(targets[0], sources[0].to(torch.bfloat16))
    # Through a bf16 wire, exactly as a cast (these values are exact in bf16).
    assert torch.equal(targets[1], sources[1].to(torch.bfloat16).float())


def test_exact_gather_keeps_every_bit() -> None:
    group = comm.self_group(comm.world_group())
    source = torch.randn(11, dtype=torch.float64)
    target = torch.empty(11, dtype=torch.float64)
    all_gather_shards([GatherPiece(source, target)], group=group, tag="t").wait()
    assert torch.equal(source, target)


def test_in_place_piece_casts_the_source_into_the_target_like_a_copy() -> None:
    # Stage 3's gather from an fp32 master: the bf16 target must hold exactly what a kept
    # bf16 shard written by `copy_` held (the same round-to-nearest cast).
    group = comm.self_group(comm.world_group())
    source = torch.randn(9, dtype=torch.float32, generator=torch.Generator().manual_seed(3))
    kept = torch.empty(9, dtype=torch.bfloat16).copy_(source)
    target = torch.full((9,), float("nan"), dtype=torch.bfloat16)
    all_gather_shards([GatherPiece(source, target, in_place=True)], group=group, tag="t",
                      wire_dtype=torch.bfloat16).wait()
    assert torch.equal(target, kept)
