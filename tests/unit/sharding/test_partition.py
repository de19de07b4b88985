"""Shard arithmetic of zeroshard/sharding/flat.py, one process: every rank's view is simulated.

`FlatParamGroup` asks `zeroshard.comm` for the world size and rank and broadcasts the
initial values; here those three are replaced, so a W-rank layout can be built for each
rank in turn without a process group.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from zeroshard.comm import collectives as comm
from zeroshard.grads.buffers import FlatGradients
from zeroshard.precision.plan import RolePlan
from zeroshard.sharding.flat import FlatParamGroup
from zeroshard.sharding.stages import stage_policy

FP32 = torch.float32
BF16 = torch.bfloat16
# fp32 training: the master weights are the parameters.
FP32_ROLE = RolePlan("all", FP32, "fp32", FP32, FP32, FP32, FP32, FP32, FP32, True)
# bf16 training: bf16 parameters, fp32 master copy.
BF16_ROLE = RolePlan("all", BF16, "bf16", BF16, FP32, FP32, BF16, FP32, FP32, False)

# Odd sizes, a 0-d parameter and a vector: the shapes that need padding.
SHAPES = [(7, 5), (5,), (), (16, 16), (3,)]


def make_params(shapes, dtype=FP32) -> list[nn.Parameter]:
    torch.manual_seed(0)
    return [nn.Parameter(torch.randn(shape, dtype=dtype)) for shape in shapes]


def build(monkeypatch, shapes, world_size: int, rank: int, stage: int = 1, role: RolePlan = FP32_ROLE):
    monkeypatch.setattr(comm, "world_size", lambda group=None: world_size)
    monkeypatch.setattr(comm, "rank", lambda group=None: rank)
    monkeypatch.setattr(comm, "broadcast", lambda tensor, src=0, group=None, tag="": tensor)
    params = make_params(shapes, role.param_dtype)
    originals = [p.detach().clone() for p in params]
    flat = FlatParamGroup(
        "unit", [f"p{i}" for i in range(len(params))], params, role, 0, stage_policy(stage), torch.device("cpu"),
        gradients=FlatGradients,
    )
    return flat, params, originals


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 7])
def test_shards_tile_the_padded_buffer(monkeypatch, world_size: int) -> None:
    """Equal shards of ceil(numel / W) elements tile [0, padded) with less than W of padding."""
    numel = sum(torch.Size(s).numel() for s in SHAPES)  # 35 + 5 + 1 + 256 + 3 = 300
    starts = []
    for rank in range(world_size):
        flat, _, _ = build(monkeypatch, SHAPES, world_size, rank)
        assert flat.numel == numel == 300
        assert flat.shard_numel == -(-numel // world_size)
        assert flat.padded_numel == flat.shard_numel * world_size
        assert 0 <= flat.padded_numel - numel < world_size
        starts.append(flat.shard_start)
        assert flat.master_range() == (flat.shard_start, flat.shard_numel)
    assert starts == [r * -(-numel // world_size) for r in range(world_size)]


@pytest.mark.parametrize("world_size", [2, 3, 4, 7])
def test_every_parameter_element_is_owned_exactly_once(monkeypatch, world_size: int) -> None:
    """Over all ranks, `param_range_in_shard` covers each parameter's elements exactly once,
    at the position the flat offsets say."""
    owner_count = {i: torch.zeros(torch.Size(s).numel(), dtype=torch.int64) for i, s in enumerate(SHAPES)}
    for rank in range(world_size):
        flat, _, _ = build(monkeypatch, SHAPES, world_size, rank)
        for index in range(len(SHAPES)):
            piece = flat.param_range_in_shard(index)
            if piece is None:
                continue
            in_shard, in_param, length = piece
            assert length > 0
            assert flat.shard_start + in_shard == flat.offsets[index] + in_param
            assert in_shard + length <= flat.shard_numel
            owner_count[index][in_param : in_param + length] += 1
    for index, counts in owner_count.items():
        assert torch.equal(counts, torch.ones_like(counts)), f"parameter {index} ({SHAPES[index]})"


def test_parameters_become_views_of_the_flat_buffer_with_zero_padding(monkeypatch) -> None:
    flat, params, originals = build(monkeypatch, SHAPES, world_size=3, rank=1)
    for p, original, offset, shape in zip(params, originals, flat.offsets, SHAPES, strict=True):
        assert p.shape == torch.Size(shape)
        assert torch.equal(p.detach(), original)
        assert p.data_ptr() == flat.full.data_ptr() + offset * flat.full.element_size()
    padding = flat.full[flat.numel :]
    assert padding.numel() == flat.padded_numel - flat.numel and bool((padding == 0).all())


def test_zero_dim_parameter_on_more_ranks_than_elements(monkeypatch) -> None:
    """One 0-d parameter on 4 ranks: one element per shard; only rank 0 owns it."""
    for rank in range(4):
        flat, params, originals = build(monkeypatch, [()], world_size=4, rank=rank)
        assert (flat.shard_numel, flat.padded_numel) == (1, 4)
        assert params[0].shape == torch.Size([]) and torch.equal(params[0].detach(), originals[0])
        assert flat.param_range_in_shard(0) == ((0, 0, 1) if rank == 0 else None)


def test_master_is_the_parameter_shard_in_fp32_and_a_copy_in_bf16(monkeypatch) -> None:
    """fp32 (stage 1): the master is a view of this rank's slice of the flat buffer, no copy.
    bf16: an fp32 copy of the same slice. Stage 0: the whole buffer."""
    flat, _, _ = build(monkeypatch, SHAPES, world_size=2, rank=1, stage=1, role=FP32_ROLE)
    assert flat.master.data_ptr() == flat.full.data_ptr() + flat.shard_start * 4
    assert flat.master.numel() == flat.shard_numel

    flat, _, _ = build(monkeypatch, SHAPES, world_size=2, rank=1, stage=1, role=BF16_ROLE)
    assert flat.master.dtype == FP32 and flat.full.dtype == BF16
    assert torch.equal(flat.master, flat.shard_of(flat.full).float())

    flat, _, _ = build(monkeypatch, SHAPES, world_size=2, rank=1, stage=0, role=FP32_ROLE)
    assert flat.master_range() == (0, flat.padded_numel)
    assert flat.master.data_ptr() == flat.full.data_ptr() and flat.master.numel() == flat.padded_numel
