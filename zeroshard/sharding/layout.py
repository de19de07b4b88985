"""The parallel layout (DESIGN section 9): which ranks shard and which replicate each flat.

Built once by `initialize` (or the Engine) from the config and the world, then passed down.
Every flat buffer carries a `ShardingSpec`; every collective names the `Group` it runs on,
so nothing reaches the default process group implicitly.

Today's dimensions:

* dense data parallelism: every dense flat is sharded over the world (`shard_group_size`
  unset), or, with `zeroshard.shard_group_size = S` (hybrid sharding, as FSDP's HSDP), over
  groups of S consecutive ranks and replicated over the W / S strided groups that hold the
  same shard index. World 4, S = 2: shard groups {0,1} and {2,3}, replica groups {0,2}
  and {1,3}.

How the next dimensions drop in (same two families of groups, same spec):

* expert parallelism, world = EP x EDP: `partition(world, ep_size, ...)` gives the
  consecutive expert-parallel groups (the all-to-all) and the strided expert-data-parallel
  groups, exactly as the hybrid split does; an expert flat's spec is
  `ShardingSpec(shard=EDP group, replicate=a group of one, peers=EDP group)`.
* sequence parallelism: the dense spec's shard group becomes data x sequence ranks (the
  sequence ranks' gradients sum like data-parallel ones); nothing else changes.

[Note: the global norm over layouts]
The norm is the sum over the world of each rank's squared shard norms, each flat's partial
divided by its replication (`ShardingSpec.replication`), then one all-reduce over the world.
That counts every tensor once whatever mixture of specs the flats have (dense flats
replicated over replica groups, expert flats sharded over EDP and distinct across EP), at
the cost of one world all-reduce. With no replication the division is skipped, so the
default layout's norm is bitwise what it was.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from zeroshard.comm import collectives as comm
from zeroshard.comm.collectives import Group

PLACEMENTS = ("device", "host")  # where a role lives; "host" with ZeRO-Offload (zeroshard/sharding/offload.py)


@dataclass(frozen=True)
class ShardingSpec:
    """How one flat is spread over ranks.

    Attributes:
        shard: the ranks that split the flat into equal shards (reduce-scatter, all-gather,
            shard arithmetic, checkpoint fragments, Muon's owners).
        replicate: the ranks holding the same shard as this one (the reduced shard is
            all-reduced over it); a group of one without replication.
        peers: every rank holding these parameters, shard x replicate (the initial broadcast,
            GatheredParameters' broadcast).
        placement: where master weights and optimizer state live ("device", or "host" with
            offload_optimizer).
        param_placement: where stage 3's parameter shard lives ("host" with offload_param).
        pin_memory: host buffers are pinned (offload's pin_memory, with a GPU present).
    """

    shard: Group
    replicate: Group
    peers: Group
    placement: str = "device"
    param_placement: str = "device"
    pin_memory: bool = False

    @property
    def replication(self) -> int:
        return self.replicate.size


def partition(
    world: Group, size: int, handles: dict[tuple[int, ...], Any] | None = None, timeout_s: float | None = None
) -> tuple[Group, Group]:
    """This rank's two groups when the world is cut into blocks of `size` consecutive ranks:
    (the consecutive block, the strided group of ranks at the same position in every block).

    The hybrid sharding split (shard groups consecutive, replica groups strided) and
    DeepSpeed's expert-parallel split (EP consecutive, EDP strided) are both this.
    Collective when either family has groups of more than one rank: every rank creates
    every group, in the same order, as torch requires.
    """
    ranks = world.ranks
    blocks = [ranks[i : i + size] for i in range(0, len(ranks), size)]
    strides = [ranks[i :: size] for i in range(size)]
    mine = world.ranks[world.rank]
    consecutive = strided = None
    for family in (blocks, strides):
        for members in family:
            group = comm.new_group(members, world, timeout_s)
            if mine in members:
                if family is blocks:
                    consecutive = group
                else:
                    strided = group
    assert consecutive is not None and strided is not None
    return consecutive, strided


@dataclass(frozen=True)
class ParallelLayout:
    """The process groups of a run and the sharding spec of its dense parameters.

    Attributes:
        world: every rank (the global norm).
        dense: the spec of every dense flat (sharded over data x sequence ranks).
        sequence: the sequence-parallel group (Ulysses; zeroshard/sequence), None without.
        data: the data-parallel group: the ranks holding the same sequence slice of
            different samples (the world without sequence parallelism).
    """

    world: Group
    dense: ShardingSpec
    sequence: Group | None = None
    data: Group | None = None

    @property
    def sequence_parallel_size(self) -> int:
        return 1 if self.sequence is None else self.sequence.size

    @property
    def data_parallel_size(self) -> int:
        """Replicas of the model that see different samples: the gradient average's
        denominator. Sequence ranks see slices of the same samples, so their gradients are
        summed, not averaged (DESIGN section 9)."""
        return self.world.size // self.sequence_parallel_size

    def with_sequence_parallel(self, sequence: Group, data: Group) -> ParallelLayout:
        """This layout with sequence parallelism: dense flats stay sharded over the same
        (data x sequence) ranks; only the averaging and the data loading change."""
        if sequence.size * data.size != self.world.size:
            raise ValueError(
                f"sequence-parallel size {sequence.size} x data-parallel size {data.size} != world size "
                f"{self.world.size}. Build the groups over every rank."
            )
        return replace(self, sequence=sequence, data=data)

    @property
    def world_size(self) -> int:
        return self.world.size

    @property
    def rank(self) -> int:
        return self.world.rank

    @classmethod
    def build(cls, shard_group_size: int | None = None, timeout_s: float | None = None) -> ParallelLayout:
        """The layout of this process's world; collective when `shard_group_size` splits it.

        `timeout_s` (zeroshard.collective_timeout_s) becomes the timeout of every group the
        layout uses, the world's included, so a frozen or dead peer is an error after it."""
        world = comm.world_group()
        if timeout_s is not None:
            comm.set_timeout(world, timeout_s)
        size = world.size if not shard_group_size else shard_group_size
        if size < 1 or world.size % size:
            raise ValueError(
                f"zeroshard.shard_group_size={shard_group_size}: must divide the world size "
                f"{world.size}. Set it to a divisor of the number of ranks, or leave it unset to shard "
                "over every rank."
            )
        if size == world.size:
            shard, replicate = world, comm.self_group(world)
        else:
            shard, replicate = partition(world, size, timeout_s=timeout_s)
        return cls(world, ShardingSpec(shard, replicate, world))

    def expert(self, edp: Group) -> ShardingSpec:
        """The spec of an expert flat whose experts are held by the expert-data-parallel group
        `edp` (zeroshard/sharding/groups.py builds it): sharded over it, replicated nowhere."""
        # Placement (device or host, pinned) is the dense spec's: offload applies to experts too.
        return replace(self.dense, shard=edp, replicate=comm.self_group(self.world), peers=edp)

    def describe(self) -> str:
        d = self.dense
        text = (
            f"world {self.world.size}: dense parameters sharded over {d.shard.size} rank(s) "
            f"{d.shard.ranks}, replicated over {d.replicate.size} {d.replicate.ranks}"
        )
        if self.sequence is not None:
            text += (
                f"; sequence parallel {self.sequence.size} {self.sequence.ranks} x data parallel "
                f"{self.data_parallel_size}: each rank holds 1/{self.sequence.size} of every sequence"
            )
        return text
