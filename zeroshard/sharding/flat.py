"""Flat parameter buffers and their shards.

[Note: flat buffers]
Each unit's trainable parameters are packed, per (precision role, optimizer param group)
class, into one 1-D buffer:

    full         1-D, padded_numel elements, parameter dtype. Module parameters are views
                 into it. At stage 3 its storage is freed between uses (resized to 0 bytes;
                 the views stay attached and see the data again once it is re-gathered).
    shard        this rank's slice of `full`: [r * shard_numel, (r+1) * shard_numel), r the
                 rank's index in the flat's shard group (`spec.shard`, zeroshard/sharding/layout.py).
                 padded_numel = shard_numel x shard group size, so every rank owns an equal
                 slice; the padding at the end is zeros and stays zero. Ranks of one replica
                 group (`spec.replicate`) hold the same shard.
    param_shard  stage 3 only: the persistent copy of this rank's slice in the parameter
                 dtype, the source of every all-gather; None where the gather casts the
                 master instead (see [Note: gathering from the master]).
    master       what the optimizer steps on: the whole buffer at stage 0, the shard at
                 stages 1-3. In the dtype `role.master_dtype`; when the plan says the master
                 weights are the parameters (fp32 and torch_autocast modes) it is a view of
                 `full` (stages 0-2) or `param_shard` itself (stage 3), never a copy.
    grads        the gradient buffers laid out like `full` (local, reduced), and their
                 lifecycle: zeroshard/grads/buffers.py's [Note: gradient buffers].
"""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from zeroshard.comm import collectives as comm
from zeroshard.precision.plan import RolePlan
from zeroshard.sharding.gather import Gathering, GatherPiece, all_gather_shards
from zeroshard.sharding.layout import ShardingSpec, current_layout
from zeroshard.sharding.offload import host_copy
from zeroshard.sharding.param_status import ZeroParamStatus
from zeroshard.sharding.ranges import overlap
from zeroshard.sharding.stages import StagePolicy
from zeroshard.sharding.streams import COMPUTE, GATHER, NULL_STREAMS, StreamSet

if TYPE_CHECKING:
    from zeroshard.sharding.fp8_gather import Fp8FlatGather


class ShardState(Enum):
    SHARDED = "sharded"  # full buffer has no storage (stage 3 between uses)
    UNSHARDED = "unsharded"  # full buffer materialised, module params valid
    # Gathered in fp8 for compute: `fp8.full` holds the weights, the module params are
    # placeholders (zeroshard/sharding/fp8_gather.py's [Note: fp8 gathers]).
    FP8 = "fp8"


class FlatParamGroup:
    """One flat buffer: a unit's parameters of one precision role and optimizer group."""

    def __init__(
        self,
        unit_name: str,
        names: list[str],
        params: list[nn.Parameter],
        role: RolePlan,
        optimizer_group: int,
        policy: StagePolicy,
        device: torch.device,
        spec: ShardingSpec | None = None,
        streams: StreamSet = NULL_STREAMS,
        *,
        gradients: Callable[[FlatParamGroup], Any],
    ) -> None:
        """`gradients` makes the flat's gradient buffers from the flat (the engine passes
        zeroshard/grads/buffers.py's `FlatGradients`; the gradient folder sits above this one,
        docs/design.md "The floors")."""
        self.unit_name = unit_name
        # Stage 3's gathers run on a side stream on CUDA (real streams there); no-ops
        # elsewhere. See [Note: streams and events] in zeroshard/sharding/streams.py.
        self.streams = streams
        self.names = names
        self.params = params
        self.role = role
        self.optimizer_group = optimizer_group
        self.policy = policy
        self.device = device
        if spec is None:  # no layout given: sharded over the whole world
            world = current_layout().world
            spec = ShardingSpec(world, comm.self_group(world), world)
        self.spec = spec
        self.shard_size = spec.shard.size
        self.shard_rank = spec.shard.rank

        self.shapes = [p.shape for p in params]
        self.numels = [p.numel() for p in params]
        self.offsets: list[int] = []
        offset = 0
        for n in self.numels:
            self.offsets.append(offset)
            offset += n
        self.numel = offset
        ws = self.shard_size
        align = spec.shard_align
        self.shard_numel = max(1, -(-self.numel // (ws * align))) * align  # ceil, at least one element
        self.padded_numel = self.shard_numel * ws
        self.shard_start = self.shard_rank * self.shard_numel

        self.full = torch.zeros(self.padded_numel, dtype=role.param_dtype, device=device)
        with torch.no_grad():
            for p, off, n in zip(params, self.offsets, self.numels, strict=False):
                self.full[off : off + n].copy_(p.detach().reshape(-1))
        # Every rank starts from the first peer's values (rank 0's for dense flats), as DeepSpeed does.
        comm.broadcast(self.full, src=spec.peers.ranks[0], group=spec.peers, tag="init")
        self._attach_views()
        self.state = ShardState.UNSHARDED

        self._pending_gather: Gathering | None = None  # the all-gather in flight
        self._pending_fp8 = False  # the gather in flight is the fp8 one
        # Stage 3, role "fp8" with an fp8 gather dtype: set by zeroshard/sharding/fp8_gather.py.
        self.fp8: Fp8FlatGather | None = None
        # Stage 3: between uses a parameter lives only as this rank's shard.
        self.params_sharded = not policy.keep_full_params
        offloaded = spec.placement != "device" or spec.param_placement != "device"
        self.gathers_from_master = self.params_sharded and master_feeds_gather(role, offloaded)
        self.param_shard: torch.Tensor | None = None
        if self.params_sharded and not self.gathers_from_master:
            if spec.param_placement == "host":  # offload_param: the gathers start from the host
                self.param_shard = host_copy(self.shard_of(self.full), role.param_dtype, spec.pin_memory)
            else:
                self.param_shard = self.shard_of(self.full).clone()

        self.master = self._make_master()
        self.grads = gradients(self)
        if not policy.keep_full_params:
            self.free_full()

    # ----------------------------------------------------------------- layout
    def shard_of(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a full-size flat tensor (a view)."""
        return flat.narrow(0, self.shard_start, self.shard_numel)

    def param_range_in_shard(self, index: int) -> tuple[int, int, int] | None:
        """(start in shard, start in param, length) of param `index`'s overlap with the shard."""
        common = overlap(
            self.offsets[index], self.offsets[index] + self.numels[index],
            self.shard_start, self.shard_start + self.shard_numel,
        )
        if common is None:
            return None
        lo, hi = common
        return lo - self.shard_start, lo - self.offsets[index], hi - lo

    def _attach_views(self) -> None:
        # Torch function modes off: the engine's own writes are no use of the parameter
        # (zeroshard/sharding/direct_use.py's mode would take them for one).
        with torch._C.DisableTorchFunction():
            for p, off, n, shape in zip(self.params, self.offsets, self.numels, self.shapes, strict=False):
                p.data = self.full.narrow(0, off, n).view(shape)
                p.ds_shape, p.ds_numel = shape, n  # the full shape, also while freed (DeepSpeed's names)
                p.ds_status = ZeroParamStatus.AVAILABLE  # DeepSpeed's name too; TRL reads it

    def _detach_views(self) -> None:
        """[Note: a freed parameter is visibly empty]
        Outside a gather a stage-3 parameter holds a 0-element tensor (numel 0, as DeepSpeed
        and FSDP1 do): `p.sum()`, `p.clone()` and `copy.deepcopy` give empty results and ops
        that need the values raise a Python error. A full-shaped view over the freed 0-byte
        storage would crash the process instead. `full` keeps its storage (resized to 0, then
        regrown by the next gather), so tensors autograd saved as views of it stay valid;
        `ds_shape` keeps the full shape. Read the values inside
        zeroshard.zero.GatheredParameters."""
        empty = self.full.new_empty(0)
        with torch._C.DisableTorchFunction():  # see _attach_views
            for p in self.params:
                p.data = empty
                p.ds_status = ZeroParamStatus.NOT_AVAILABLE

    # ----------------------------------------------------------------- master
    @property
    def master_is_own_copy(self) -> bool:
        """The master is a tensor of its own, not the parameter buffer (or its shard)."""
        return not self.role.master_is_param or self.master is not self._param_home()

    def _param_home(self) -> torch.Tensor:
        if self.param_shard is not None:
            return self.param_shard
        return self.shard_of(self.full) if self.policy.shard_optimizer else self.full

    def _make_master(self) -> torch.Tensor:
        role = self.role
        home = self.spec.param_placement if self.params_sharded else "device"
        if self.spec.placement != home:
            # Offload: the master lives apart from the parameters (zeroshard/sharding/offload.py), in
            # its own copy even when the plan says the masters are the parameters.
            if self.spec.placement == "host":
                return host_copy(self._param_home(), role.master_dtype, self.spec.pin_memory)
            return self._param_home().to(device=self.device, dtype=role.master_dtype, copy=True)
        if role.master_is_param:
            if self.param_shard is not None:
                return self.param_shard
            return self.shard_of(self.full) if self.policy.shard_optimizer else self.full
        source = self.shard_of(self.full) if self.policy.shard_optimizer else self.full
        return source.detach().to(role.master_dtype, copy=True)

    def master_range(self) -> tuple[int, int]:
        """(start, length) of the master's elements within the full flat buffer."""
        if self.policy.shard_optimizer:
            return self.shard_start, self.shard_numel
        return 0, self.padded_numel

    # ------------------------------------------------------ full buffer storage
    @property
    def full_held(self) -> bool:
        """Stage 3: the full buffer holds storage (gathered, or a gather in flight)."""
        return self.params_sharded and (self.state is not ShardState.SHARDED or self._pending_gather is not None)

    def free_full(self) -> None:
        if self.policy.keep_full_params:
            return
        if self._pending_gather is not None:
            self.finish_gather()  # never free memory a collective is still writing
        if self.state is ShardState.SHARDED:
            return
        # Compute waited on the gather's event (finish_gather): the release is in compute order.
        self.streams.released(self.unit_name)
        if self.state is ShardState.UNSHARDED:
            self.full.untyped_storage().resize_(0)
        if self.fp8 is not None:
            self.fp8.release()
        self._detach_views()
        self.state = ShardState.SHARDED

    def release_exact(self) -> None:
        """Back from an exact gather on top of an fp8 one to the fp8 state (GatheredParameters
        inside a forward that computes from the fp8 bytes)."""
        if self.state is ShardState.UNSHARDED and self.fp8 is not None and self.fp8.held:
            self.full.untyped_storage().resize_(0)
            self.fp8.attach()
            self.state = ShardState.FP8

    def start_gather(self, tag: str = "param", exact: bool = False) -> None:
        """Begin materialising the full buffer from every rank's `param_shard` (stage 3).

        Asynchronous: `finish_gather` (or `gather_full`) waits for it. Used to prefetch the
        next unit while the current one computes. The wire carries the plan's gather dtype,
        or with `exact` the parameter dtype (for users reading parameters, not for compute).
        """
        if self.state is ShardState.UNSHARDED or self._pending_gather is not None:
            return
        assert self.params_sharded
        fp8 = self.fp8 is not None and not exact
        if fp8 and self.state is ShardState.FP8:
            return
        if fp8:
            self.fp8.table.ensure()  # the step's amax all-reduce, before its first fp8 gather
        # Allocated on the compute stream; the gather stream writes it only after compute's
        # queued work so far (the allocation, the step's writes of param_shard or the master).
        if fp8:
            self.fp8.allocate()
        else:
            self.full.untyped_storage().resize_(self.padded_numel * self.full.element_size())
        streams = self.streams
        ready = streams.record(COMPUTE, f"gather-ready:{self.unit_name}")
        wire = None if exact else self.role.gather_dtype
        with streams.on(GATHER):
            streams.wait(GATHER, ready)
            self._pending_fp8 = fp8
            if fp8:
                self._pending_gather = self.fp8.start(tag)
            else:
                self._pending_gather = all_gather_shards(
                    [self._gather_piece(wire)], group=self.spec.shard, tag=tag, wire_dtype=wire,
                )

    def _gather_piece(self, wire: torch.dtype | None) -> GatherPiece:
        """[Note: gathering from the master]
        Stage 3 with a wider master on the parameter's device (bf16/fp16 parameters, fp32
        masters, no offload) keeps no parameter-dtype shard: it would only ever hold the
        master cast to the parameter dtype (publish wrote exactly that after each step, and
        every other writer writes both). The gather casts the master instead, straight into
        this rank's slot of `full` (an in-place all-gather), so no shard-sized buffer lives
        between uses: 2 bytes per parameter less for bf16, as FSDP2 keeps only the fp32
        sharded parameter. The bits are the same cast of the same master. When the wire
        dtype is not the parameter dtype the value takes both roundings, as it did from the
        parameter shard: master to parameter dtype (a transient copy), then to the wire."""
        if self.param_shard is not None:
            return GatherPiece(self.param_shard, self.full)
        if wire is None or wire == self.full.dtype:
            return GatherPiece(self.master, self.full, in_place=True)
        return GatherPiece(self.master.to(self.full.dtype), self.full)

    def finish_gather(self) -> None:
        if self._pending_gather is None:
            return
        pending, self._pending_gather = self._pending_gather, None
        streams = self.streams
        with streams.on(GATHER):
            pending.wait()  # the gather stream joins the collective (and copies out a bucket)
            done = streams.record(GATHER, f"gather-done:{self.unit_name}")
        streams.wait(COMPUTE, done)  # before any read of the gathered parameters or a free
        if self._pending_fp8:
            self.fp8.attach()
            self.state = ShardState.FP8
        else:
            self._attach_views()
            self.state = ShardState.UNSHARDED

    def gather_full(self, tag: str = "param", exact: bool = False) -> None:
        """Materialise the full buffer now (waiting for a prefetch already in flight)."""
        if self.state is ShardState.UNSHARDED:
            return
        if self._pending_gather is not None and self._pending_fp8 and exact:
            self.finish_gather()  # the fp8 prefetch first; the exact gather goes on top
        if self.state is ShardState.FP8 and not exact:
            return
        self.start_gather(tag, exact)
        self.finish_gather()

    def needs_gather_to_publish(self) -> bool:
        """Stages 1-2: the master is a shard but every rank keeps the full parameters, so
        publishing is an all-gather (zeroshard/step/publish.py buckets those across flats)."""
        return self.policy.shard_optimizer and not self.params_sharded

    def publish_master(self) -> None:
        """After an optimizer step, without communication (stages 0 and 3): make the module
        parameters (stage 3: this rank's parameter shard) equal the new master values. Stages
        1-2 publish through `zeroshard.step.publish.publish_masters`, which all-gathers."""
        assert not self.needs_gather_to_publish(), "stages 1-2 publish with publish_masters"
        with torch.no_grad():
            if self.params_sharded:  # stage 3: params stay sharded
                if self.fp8 is not None:
                    self.fp8.table.invalidate()  # new weights, new scales
                # Gathering from the master: nothing to copy, the next gather casts it.
                if self.param_shard is not None and self.param_shard is not self.master:
                    self.param_shard.copy_(self.master)
            elif self.master_is_own_copy:  # stage 0 with a separate master
                self.full.copy_(self.master)

    # ------------------------------------------------- writes from outside training
    def load_master(self, values: torch.Tensor) -> None:
        """Set the master weights (laid out as `master_range()` says) from a checkpoint. The
        module parameters follow at the next `publish_masters`; call `free_full` afterwards
        at stage 3 (a gathered copy would be stale)."""
        with torch.no_grad():
            self.master.copy_(values.to(self.master.device))

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict) -> None:
        """Install `state` (elementwise tensors laid out like the master) as `optimizer`'s
        state for this flat's master, on the master's device; 0-d tensors (`step`) stay on the
        host unless the optimizer reads them on the device (fused or capturable Adam)."""
        group = next((g for g in optimizer.param_groups if any(p is self.master for p in g["params"])), {})
        # Fused and capturable Adam read `step` in their kernels, on the masters' device;
        # otherwise torch keeps it on the host, where reading it waits for nothing.
        device_scalars = bool(group.get("fused") or group.get("capturable"))
        optimizer.state[self.master] = {
            k: v.to(self.master.device) if isinstance(v, torch.Tensor) and (v.dim() > 0 or device_scalars) else v
            for k, v in state.items()
        }

    def write_back_full(self, changed: torch.Tensor) -> None:
        """Make the parameter shard and the master agree with `full` where `changed` (a
        full-size mask) is set; an untouched element keeps its master value (a bf16
        parameter must not round an fp32 master it did not change). GatheredParameters'
        modifier path."""
        full = self.full
        if self.fp8 is not None:
            self.fp8.table.invalidate()
        with torch.no_grad():
            if self.param_shard is not None:
                at = self.param_shard.device  # the host with offload_param
                shard_changed = self.shard_of(changed).to(at)
                self.param_shard.copy_(torch.where(shard_changed, self.shard_of(full).to(at), self.param_shard))
            source = full if not self.policy.shard_optimizer else self.shard_of(full)
            if self.master is source or self.master is self.param_shard or not self.master_is_own_copy:
                return  # the master is the parameter buffer itself: already written
            mask = changed if not self.policy.shard_optimizer else self.shard_of(changed)
            at = self.master.device
            self.master.copy_(torch.where(mask.to(at), source.to(device=at, dtype=self.master.dtype), self.master))

    # ----------------------------------------------------------------- views
    def param_view(self, flat: torch.Tensor, index: int) -> torch.Tensor:
        """Parameter `index`'s part of a tensor laid out like `full`, in the parameter's shape."""
        return flat.narrow(0, self.offsets[index], self.numels[index]).view(self.shapes[index])


def master_feeds_gather(role: RolePlan, offloaded: bool) -> bool:
    """Whether a stage-3 flat's gathers cast its master instead of keeping a parameter shard
    (zeroshard/tools/memory.py counts the same): the master holds exactly the shard's range
    (stage 3 shards it like the parameters), on the parameters' device, in a wider floating
    dtype. Not with offload (`offloaded`: the master or the parameter shard on the host), nor
    where the master is the parameter shard itself or as narrow as it
    (bf16_master_weights_and_gradients)."""
    if role.master_is_param or offloaded:
        return False
    master, param = role.master_dtype, role.param_dtype
    return master.is_floating_point and param.is_floating_point and master.itemsize > param.itemsize
