"""The parallel layout (docs/design.md section 9): every parallel dimension of a run, in one object.

[Note: one layout per process]
There is exactly one `ParallelLayout` object per process (per process group): `current_layout()`
returns it, creating it on demand from the world the first time anything asks for a group (a
DeepSpeed `MoE` layer built before `initialize`, `parallel_state_sp`, zero.Init, the
`groups` getters). `initialize` (and an Engine built without one) then takes that same object
through `establish()`, cuts its dense dimension as the config asks, sets its sequence
dimension, and hands it down: the engine, MoE and AutoEP layers, the load balancer, sequence
layers, checkpoint I/O. The DeepSpeed getters (zeroshard/groups/__init__.py,
zeroshard/sequence/parallel_state_sp.py) are read-only views onto it; no module keeps a group
of its own. When the default process group is replaced (destroy_process_group, then a new
init), the next `current_layout()` sees a different world and starts a new layout for it,
forgetting every group of the old one (torch destroyed them).

Groups are built once and kept: every split (hybrid shard/replica pairs by size, expert
groups by ep_size) is cached, so a second engine with the same config creates no new
process group. Each `initialize` re-cuts the dense and sequence dimensions for its config:
the flats of an engine already built keep the specs they were built with, but its
`seq_parallel_group` / `data_parallel_group` read the layout's current ones, so two engines
alive at once must agree on sequence parallelism. (With offload the engine holds a copy
naming host placement, zeroshard/sharding/offload.py `place_layout`; the copy shares every
group table with the one layout.)

Dimensions (world W; every split is `partition`: consecutive blocks and the strided groups
at the same position in every block, collectively created by every rank in the same order):

* dense data parallelism: dense flats are sharded over the world (`shard_group_size` unset),
  or, with `zeroshard.shard_group_size = S` (hybrid sharding, as FSDP's HSDP), over blocks of
  S consecutive ranks and replicated over the W / S strided groups. W 4, S 2: shard {0,1}
  {2,3}, replica {0,2} {1,3}.
* expert parallelism, W = EP x EDP, DeepSpeed's default "E + D" placement (deepspeed/utils/
  groups.py `_create_expert_and_data_parallel` without model parallelism): expert-parallel
  groups are blocks of ep_size consecutive ranks (the all-to-all), expert-data-parallel groups
  the strided ranks holding the same experts. W 4, ep 2: EP {0,1} {2,3}, EDP {0,2} {1,3}.
  DeepSpeed's `use_data_before_expert_parallel_` ("D + E": EDP consecutive, EP strided) is
  refused by the MoE layer: expert ownership (`ep_rank`, checkpoint names) assumes E + D.
  Sequence parallelism does not change it (DeepSpeed's MoE layer takes that same path when
  its mpu is a sequence-parallel one).
* sequence parallelism, W = DP x SP: sequence groups are blocks of SP consecutive ranks,
  data groups the strided ranks holding the same slice of different samples, and the
  sequence-data-parallel group (dense flats are sharded over it) is the world. W 4, SP 2:
  SP {0,1} {2,3}, data {0,2} {1,3}.
* tensor parallelism (AutoTP, `tensor_parallel.autotp_size = T`), W = DP x TP, DeepSpeed's
  placement (groups._init_tp_mesh_device: a (dp, tp) mesh, the tensor dimension innermost):
  tensor groups are blocks of T consecutive ranks (the activations' all-reduces), tensor-data
  groups the strided ranks holding the same pieces; dense flats are sharded over the
  tensor-data group. A parameter AutoTP keeps whole is the same on every rank of a tensor group
  (`ShardingSpec.duplicate`). W 4, T 2: TP {0,1} {2,3}, data {0,2} {1,3}. Not combined with
  hybrid sharding or sequence parallelism (refused in the resolve pass).

[Note: the global norm over layouts]
The norm is the sum over the world of each rank's squared shard norms, each flat's partial
divided by the number of ranks holding it (`ShardingSpec.copies`: its replication times its
duplicates), then one all-reduce over the world. That counts every tensor once whatever
mixture of specs the flats have (dense flats replicated over replica groups, expert flats
sharded over EDP and distinct across EP, a parameter tensor parallelism keeps whole held by
every rank of its tensor group, each piece of a split one by one rank), at the cost of one
world all-reduce. With one copy the division is skipped, so the default layout's norm is
bitwise what it was.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from types import MappingProxyType
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
        duplicate: ranks that hold these same values and compute the same gradient on their
            own, so nothing is reduced over them: the tensor group of a parameter tensor
            parallelism keeps whole. The norm counts their copies once; None otherwise.
    """

    shard: Group
    replicate: Group
    peers: Group
    placement: str = "device"
    param_placement: str = "device"
    pin_memory: bool = False
    duplicate: Group | None = None
    shard_align: int = 1  # shard sizes are a multiple of this (the deterministic reduction's norm blocks)

    @property
    def replication(self) -> int:
        return self.replicate.size

    def source_for(self, rank: int) -> int:
        """The member of `peers` that holds what global rank `rank` holds here: `rank` itself, or,
        when `rank` holds another tensor-parallel piece (peers strided over the tensor groups),
        the peer at `rank`'s data-parallel position (GatheredParameters' modifier_rank)."""
        ranks = self.peers.ranks
        if rank in ranks:
            return rank
        stride = ranks[1] - ranks[0] if len(ranks) > 1 else 1
        position = rank // stride
        strided = all(b - a == stride for a, b in zip(ranks[:-1], ranks[1:], strict=True))
        if len(ranks) > 1 and strided and position < len(ranks):
            return ranks[position]
        raise ValueError(f"rank {rank} has no counterpart among ranks {list(ranks)}.")

    @property
    def copies(self) -> int:
        """How many ranks hold each element of a shard (replicas x duplicates): the global norm
        divides a flat's partial by it."""
        return self.replicate.size * (1 if self.duplicate is None else self.duplicate.size)


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


def expert_group_name(ep_size: int) -> str:
    """DeepSpeed's name of the expert groups for `ep_size`."""
    return f"ep_size_{ep_size}"


def check_ep_size(ep_size: int, world_size: int) -> None:
    """Refuse an expert-parallel size the world cannot be cut into."""
    if not isinstance(ep_size, int) or ep_size < 1 or world_size % ep_size:
        raise ValueError(
            f"ep_size={ep_size}: must be a positive divisor of the world size {world_size} "
            "(world = expert-parallel x expert-data-parallel ranks). Pick an ep_size that divides "
            "the number of ranks."
        )


@dataclass(frozen=True)
class SequenceParallelGroups:
    """The sequence-parallel mpu's groups for this rank (global ranks in `.ranks`), each with a
    torch ProcessGroup handle even for one member (users pass them to torch.distributed).

    Attributes:
        sequence: the SP consecutive ranks sharing one sample's sequence.
        data: the DP strided ranks holding the same sequence slice of different samples.
        sequence_data: every rank of the layout (data x sequence).
    """

    sequence: Group
    data: Group
    sequence_data: Group


@dataclass(eq=False)
class ParallelLayout:
    """The process groups of a run and the sharding spec of its dense parameters: one object
    per process ([Note: one layout per process]).

    Attributes:
        world: every rank (the global norm, checkpoint agreement).
        dense: the spec of every dense flat (sharded over data x sequence ranks).
        sequence: the sequence-parallel group the engine trains with (Ulysses;
            zeroshard/sequence), None without.
        data: the data-parallel group: the ranks holding the same sequence slice of
            different samples (None without sequence parallelism: the world).
        expert_parallel, expert_data_parallel: by expert group name (`ep_size_<n>`), this
            rank's EP and EDP groups; read them through `expert_groups` (builds on demand).
        sequence_mpu: the groups `parallel_state_sp.initialize_sequence_parallel` built (the
            mpu module's view), None until then and after `destroy_sequence_parallel`.
        mpu: the sequence-parallel mpu `initialize` was given (or parallel_state_sp), which
            DeepSpeed's `groups._get_sequence_parallel_*` read.
    """

    world: Group
    dense: ShardingSpec
    sequence: Group | None = None
    data: Group | None = None
    expert_parallel: dict[str, Group] = field(default_factory=dict)
    expert_data_parallel: dict[str, Group] = field(default_factory=dict)
    sequence_mpu: SequenceParallelGroups | None = None
    mpu: Any = None
    tensor: Group | None = None
    tensor_data: Group | None = None
    # (shard size, timeout) -> (shard, replicate): hybrid splits already built.
    _dense_splits: dict[tuple[int, float | None], tuple[Group, Group]] = field(default_factory=dict)
    # (tensor size, timeout) -> (tensor, tensor data): tensor-parallel splits already built.
    _tensor_splits: dict[tuple[int, float | None], tuple[Group, Group]] = field(default_factory=dict)

    @classmethod
    def of_world(cls, world: Group) -> ParallelLayout:
        """A layout of `world` with no dimension cut yet: dense flats sharded over every rank."""
        return cls(world, ShardingSpec(world, comm.self_group(world), world))

    @classmethod
    def build(cls, shard_group_size: int | None = None, timeout_s: float | None = None) -> ParallelLayout:
        """The process's layout with its dense dimension cut for `shard_group_size` (the one
        object, not a new one: see `establish`)."""
        return establish(shard_group_size, timeout_s)

    # ------------------------------------------------------------------ dense
    def cut_dense(self, shard_group_size: int | None = None, timeout_s: float | None = None) -> None:
        """Shard dense flats over blocks of `shard_group_size` consecutive ranks, replicated over
        the strided groups (the world when unset); collective the first time a size is cut."""
        world = self.world
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
            key = (size, timeout_s)
            if key not in self._dense_splits:
                self._dense_splits[key] = partition(world, size, timeout_s=timeout_s)
            shard, replicate = self._dense_splits[key]
        self.dense = ShardingSpec(shard, replicate, world)

    def expert(self, edp: Group | str) -> ShardingSpec:
        """The spec of an expert flat whose experts are held by the expert-data-parallel group
        `edp` (or the EDP group of expert group name `edp`): sharded over it, replicated nowhere."""
        if isinstance(edp, str):
            edp = self.expert_data_parallel[edp]
        # Placement (device or host, pinned) is the dense spec's: offload applies to experts too.
        return replace(self.dense, shard=edp, replicate=comm.self_group(self.world), peers=edp)

    # ------------------------------------------------------------------ tensor
    @property
    def tensor_parallel_size(self) -> int:
        return 1 if self.tensor is None else self.tensor.size

    def set_tensor_parallel(self, size: int, timeout_s: float | None = None) -> ParallelLayout:
        """Split Linear layers over blocks of `size` consecutive ranks (DeepSpeed's placement: the
        tensor dimension innermost) and shard dense flats over the strided tensor-data groups,
        the ranks that hold the same pieces; 1: no tensor parallelism. Collective the first
        time a size is cut. Returns this layout."""
        world = self.world
        if size <= 1:
            self.tensor = self.tensor_data = None
            return self
        if world.size % size:
            raise ValueError(
                f"tensor_parallel.autotp_size={size}: must divide the world size {world.size}. Launch a multiple "
                "of it ranks, or pick a divisor."
            )
        if self.dense.replicate.size > 1:  # hybrid sharding's replica groups
            raise ValueError(
                "zeroshard.shard_group_size: hybrid sharding with tensor parallelism (tensor_parallel.autotp_size="
                f"{size}) is not supported. Remove one of them."
            )
        key = (size, timeout_s)
        if key not in self._tensor_splits:
            self._tensor_splits[key] = partition(world, size, timeout_s=timeout_s)
        self.tensor, self.tensor_data = self._tensor_splits[key]
        self.dense = replace(self.dense, shard=self.tensor_data, replicate=comm.self_group(world),
                             peers=self.tensor_data)
        return self

    def tensor_whole(self) -> ShardingSpec:
        """The spec of a flat of parameters tensor parallelism keeps whole: sharded like the
        pieces (over the tensor-data group), the same values on every rank of the tensor group
        (`duplicate`), starting from rank 0's (`peers`: the world)."""
        if self.tensor is None:
            return self.dense
        return replace(self.dense, peers=self.world, duplicate=self.tensor)

    # ------------------------------------------------------------------ experts
    def expert_groups(self, ep_size: int) -> tuple[Group, Group]:
        """This rank's (expert-parallel, expert-data-parallel) groups for `ep_size`; built the
        first time (collective: every rank asks for the same sizes in the same order, as every
        MoE layer of a model is built on every rank)."""
        name = expert_group_name(ep_size)
        if name not in self.expert_parallel:
            check_ep_size(ep_size, self.world.size)
            ep, edp = partition(self.world, ep_size)
            self.expert_parallel[name] = ep
            self.expert_data_parallel[name] = edp
        return self.expert_parallel[name], self.expert_data_parallel[name]

    def expert_parallel_rank(self, ep_size: int) -> int:
        """This rank's index in its expert-parallel group for `ep_size` (which block of experts it
        holds), known without building the groups: EP groups are consecutive blocks."""
        return self.world.ranks[self.world.rank] % ep_size

    def expert_parallel_view(self) -> MappingProxyType:
        return MappingProxyType(self.expert_parallel)

    def expert_data_parallel_view(self) -> MappingProxyType:
        return MappingProxyType(self.expert_data_parallel)

    # ------------------------------------------------------------------ sequence
    @property
    def sequence_parallel_size(self) -> int:
        return 1 if self.sequence is None else self.sequence.size

    @property
    def data_parallel_size(self) -> int:
        """Replicas of the model that see different samples: the gradient average's
        denominator. Sequence ranks see slices of the same samples, so their gradients are
        summed, not averaged (docs/design.md section 9); tensor ranks see the same samples and
        hold different pieces of the model."""
        return self.world.size // (self.sequence_parallel_size * self.tensor_parallel_size)

    def set_sequence_parallel(self, sequence: Group | None, data: Group | None) -> ParallelLayout:
        """Train with sequence parallelism over `sequence` x `data` (None, None: without);
        dense flats stay sharded over the same (data x sequence) ranks: only the averaging and
        the data loading change. Returns this layout."""
        if sequence is not None and sequence.size * data.size != self.world.size:
            raise ValueError(
                f"sequence-parallel size {sequence.size} x data-parallel size {data.size} != world size "
                f"{self.world.size}. Build the groups over every rank."
            )
        self.sequence, self.data = sequence, data
        return self

    def init_sequence_mpu(self, sequence_parallel_size: int) -> SequenceParallelGroups:
        """Build the sequence-parallel mpu's groups (collective: every rank calls it)."""
        if self.sequence_mpu is not None:
            raise RuntimeError(
                "sequence parallelism is already initialized in this process. Call destroy_sequence_parallel() first."
            )
        world, size = self.world, sequence_parallel_size
        if not isinstance(size, int) or size < 1 or world.size % size:
            raise ValueError(
                f"sequence_parallel_size={size}: must be a positive divisor of the world size {world.size}. "
                "Launch a multiple of it ranks, or pick a divisor."
            )
        blocks = [world.ranks[i : i + size] for i in range(0, world.size, size)]
        strides = [world.ranks[i::size] for i in range(size)]
        me = world.ranks[world.rank]

        def mine(family: list[tuple[int, ...]]) -> Group:
            found = None
            for members in family:  # every rank creates every group, in the same order
                group = comm.new_process_group(members, world)
                if me in members:
                    found = group
            assert found is not None
            return found

        sequence, data = mine(blocks), mine(strides)
        self.sequence_mpu = SequenceParallelGroups(sequence, data, world)
        return self.sequence_mpu

    def drop_sequence_mpu(self) -> None:
        """Forget the mpu's groups (torch keeps the process groups until the default group goes;
        an engine training with them keeps its `sequence` and `data`)."""
        self.sequence_mpu = None

    # ------------------------------------------------------------------ world
    @property
    def world_size(self) -> int:
        return self.world.size

    @property
    def rank(self) -> int:
        return self.world.rank

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
        if self.tensor is not None:
            text += (
                f"; tensor parallel {self.tensor.size} {self.tensor.ranks} x data parallel "
                f"{self.tensor_data.size} {self.tensor_data.ranks}: each rank holds 1/{self.tensor.size} of every "
                "split layer"
            )
        for name, ep in self.expert_parallel.items():
            edp = self.expert_data_parallel[name]
            text += f"; {name}: expert parallel {ep.ranks}, expert data parallel {edp.ranks}"
        return text


class _Current:
    """The one layout of this process (a holder, not a group table: see the module note)."""

    layout: ParallelLayout | None = None


def _same_world(a: Group, b: Group) -> bool:
    """Whether `a` and `b` name the same live default process group (or both none)."""
    if a.ranks != b.ranks or a.rank != b.rank:
        return False
    if a.handle_ref is None or b.handle_ref is None:
        return a.handle_ref is None and b.handle_ref is None
    handle = a.handle_ref()
    return handle is not None and handle is b.handle_ref()


def current_layout() -> ParallelLayout:
    """The process's layout, created from the world the first time (and again after the
    default process group was replaced)."""
    world = comm.world_group()
    layout = _Current.layout
    if layout is None or not _same_world(layout.world, world):
        layout = _Current.layout = ParallelLayout.of_world(world)
    return layout


def establish(shard_group_size: int | None = None, timeout_s: float | None = None) -> ParallelLayout:
    """The process's layout, made ready for a new engine: the dense dimension cut for
    `shard_group_size`, without sequence parallelism (the caller sets it), every expert group
    kept. Collective when a new hybrid split is needed.

    `timeout_s` (zeroshard.collective_timeout_s) becomes the timeout of every group the
    layout uses, the world's included, so a frozen or dead peer is an error after it."""
    layout = current_layout()
    if timeout_s is not None:
        comm.set_timeout(layout.world, timeout_s)
    layout.cut_dense(shard_group_size, timeout_s)
    layout.set_sequence_parallel(None, None)
    layout.tensor = layout.tensor_data = None  # initialize cuts it for its config (set_tensor_parallel)
    return layout
