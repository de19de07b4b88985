"""One `ParallelLayout` per process (zeroshard/sharding/layout.py): every entry point returns
the same object, and the DeepSpeed getters read it (single process, no process group)."""

from __future__ import annotations

import torch

from zeroshard import groups
from zeroshard.moe.layer import MoE
from zeroshard.sequence import parallel_state_sp
from zeroshard.sharding.layout import ParallelLayout, current_layout, establish


def test_every_entry_point_returns_the_one_layout() -> None:
    layout = current_layout()
    assert current_layout() is layout
    assert establish() is layout
    assert ParallelLayout.build() is layout
    assert layout.world.ranks == (0,) and layout.dense.shard.ranks == (0,)


def test_expert_groups_live_in_the_layout() -> None:
    layer = MoE(4, torch.nn.Linear(4, 4), num_experts=2, ep_size=1)
    layer.set_deepspeed_parallelism()
    layout = current_layout()
    ep, edp = layout.expert_groups(1)
    assert groups._get_expert_parallel_group("ep_size_1") is ep is layer.deepspeed_moe.ep_group
    assert groups._get_expert_data_parallel_group("ep_size_1") is edp
    assert dict(groups._get_expert_parallel_group_dict()) == {"ep_size_1": ep}
    assert groups._get_max_expert_size() >= 1
    assert groups._get_data_parallel_group() is layout.world


def test_without_sequence_parallelism_the_getters_say_so() -> None:
    """The mpu's groups need a process group (tests/dist/sequence covers them); without one
    the layout holds none and DeepSpeed's getters report no sequence parallelism."""
    assert current_layout().sequence_mpu is None and not parallel_state_sp.is_initialized()
    assert (groups._get_sequence_parallel_group(), groups._get_sequence_parallel_world_size(),
            groups._get_sequence_parallel_rank()) == (None, 1, 0)
    assert groups._get_sequence_data_parallel_world_size() == 1
