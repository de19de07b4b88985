"""Stage 3's fp8 gather of the fp8 Linears' weights (the plan's role "fp8", tensorwise).

[Note: fp8 gathers]
A flat of the "fp8" group (zeroshard/precision/fp8.py's [Note: fp8 compute]) whose gather dtype
is float8_e4m3fn is gathered for compute in fp8, as torchao's FSDP2 recipe does
(WeightWithDynamicFloat8CastTensor's fsdp_pre_all_gather / fsdp_post_all_gather and
precompute_float8_dynamic_scale_for_fsdp), adapted to flat buffers:

* Scales, once per step: each weight's scale is e4m3's largest value over the weight's amax
  (torchao's tensorwise scale). A weight's elements lie in several ranks' shards, so each rank
  takes the amax of its pieces of every fp8 weight of every such flat sharded over one group,
  and one all-reduce (MAX) of that vector gives every weight's amax (`Fp8Scales.ensure`, before
  the step's first fp8 gather; the step, a load and GatheredParameters' writes mark the scales
  stale). The amax is of the bf16 parameter values (the master cast to bf16, as the bf16
  gather would send), so the scale is exactly the one torchao's dynamic cast computes from the
  gathered bf16 weight at stages 0-2.
* Gather: this rank's shard of the bf16 values is cast with those scales into its slot of a
  1-byte buffer `full` (this file's `Fp8FlatGather`), which is all-gathered in place through
  the one gather (zeroshard/sharding/gather.py): float8_e4m3fn on the wire, half bf16's bytes.
* Compute: each weight Parameter gets the attribute `FP8_GATHERED` = (its fp8 view of the
  buffer, its scale), from which `Fp8Linear` builds torchao's fp8 weight; its matmuls are then
  bit for bit those of the dynamic cast (same scale, same bytes). The gradient still reaches
  the Parameter, which holds, while so gathered, a bf16 placeholder of the full shape (one NaN
  element, expanded: no memory) instead of values. So a reader of such a weight other than its
  Fp8Linear would see NaN: the engine's readers gather exactly instead (GatheredParameters,
  exports, checkpoints, and a parameter used outside its unit, zeroshard/sharding/direct_use.py),
  and a model that reads an fp8 Linear's weight inside its unit by other means lists that
  module in `zeroshard.fp8.exclude_modules`.

The flat's bf16 `full` buffer holds no storage during an fp8 gather: a gathered unit costs 1
byte per fp8 weight element, as under FSDP2 with torchao.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from zeroshard.comm import collectives as comm
from zeroshard.comm.collectives import Group
from zeroshard.sharding.gather import Gathering, GatherPiece, all_gather_shards
from zeroshard.sharding.param_status import ZeroParamStatus

if TYPE_CHECKING:
    from zeroshard.sharding.flat import FlatParamGroup

E4M3 = torch.float8_e4m3fn


class Fp8Scales:
    """The scales of every fp8-gathered weight sharded over one group (see the note)."""

    def __init__(self, group: Group) -> None:
        self.group = group
        self.members: list[Fp8FlatGather] = []
        self.fresh = False

    def invalidate(self) -> None:
        """The master weights changed (a step, a load, a write): recompute before the next gather."""
        self.fresh = False

    def ensure(self) -> None:
        """A collective over the group on the first call after `invalidate` (every member rank
        reaches it at its first fp8 gather of the step, in the same order)."""
        if self.fresh:
            return
        from zeroshard.precision.fp8_linear import fp8_scale

        amax = torch.cat([member.local_amax() for member in self.members])
        comm.all_reduce(amax, group=self.group, op=dist.ReduceOp.MAX, tag="fp8_amax")
        scales = fp8_scale(amax)
        start = 0
        for member in self.members:
            n = member.scales.numel()
            member.scales.copy_(scales[start : start + n])
            start += n
        self.fresh = True


class Fp8FlatGather:
    """One flat's fp8 gathers: its 1-byte full buffer, its weights' scales and placeholders."""

    def __init__(self, flat: FlatParamGroup, scales: Fp8Scales) -> None:
        from zeroshard.precision.fp8_linear import FP8_GATHERED

        self.flat = flat
        self.attribute = FP8_GATHERED
        self.table = scales
        device = flat.device
        self.full = torch.zeros(flat.padded_numel, dtype=E4M3, device=device)
        self.full.untyped_storage().resize_(0)
        self.scales = torch.ones(len(flat.params), dtype=torch.float32, device=device)
        # What a weight Parameter holds while gathered in fp8 (the note: NaN, never values).
        self.placeholder = torch.full((1,), float("nan"), dtype=flat.role.param_dtype, device=device)
        self.ranges = [flat.param_range_in_shard(i) for i in range(len(flat.params))]
        self.held = False
        scales.members.append(self)

    def _bf16_shard(self) -> torch.Tensor:
        """This rank's shard in the parameter dtype (the master cast, when there is no shard)."""
        flat = self.flat
        if flat.param_shard is not None:
            return flat.param_shard.to(flat.device)
        return flat.master.to(device=flat.device, dtype=flat.role.param_dtype)

    @torch.no_grad()
    def local_amax(self) -> torch.Tensor:
        """max |value| over this rank's piece of each weight (0 where it holds none), fp32."""
        shard = self._bf16_shard()
        amax = torch.zeros(len(self.ranges), dtype=torch.float32, device=self.flat.device)
        for i, where in enumerate(self.ranges):
            if where is not None:
                start, _, length = where
                amax[i] = shard.narrow(0, start, length).abs().max()
        return amax

    def allocate(self) -> None:
        """Storage for the gathered bytes (on the compute stream, before `start`)."""
        self.full.untyped_storage().resize_(self.flat.padded_numel)
        self.held = True

    @torch.no_grad()
    def start(self, tag: str) -> Gathering:
        """Cast this rank's shard into its slot of the fp8 buffer and start the all-gather
        (after `Fp8Scales.ensure` and `allocate`)."""
        from zeroshard.precision.fp8_linear import fp8_cast

        flat = self.flat
        slot = self.full.narrow(0, flat.shard_start, flat.shard_numel)
        shard = self._bf16_shard()
        covered = max(0, min(flat.numel - flat.shard_start, flat.shard_numel))
        if covered < flat.shard_numel:
            slot[covered:].zero_()  # the padding after the last parameter
        for i, where in enumerate(self.ranges):
            if where is not None:
                start, _, length = where
                fp8_cast(shard.narrow(0, start, length), self.scales[i], slot.narrow(0, start, length))
        return all_gather_shards(
            [GatherPiece(slot, self.full, in_place=True)], group=flat.spec.shard, tag=tag, wire_dtype=E4M3
        )

    def attach(self) -> None:
        """The weights compute from the gathered bytes; the Parameters hold placeholders."""
        flat = self.flat
        with torch._C.DisableTorchFunction():  # the engine's own writes (flat.py's _attach_views)
            for i, (p, off, n, shape) in enumerate(zip(flat.params, flat.offsets, flat.numels, flat.shapes,
                                                       strict=True)):
                p.data = self.placeholder.expand(shape)
                p.ds_status = ZeroParamStatus.NOT_AVAILABLE  # no values here: read them exactly
                setattr(p, self.attribute, (self.full.narrow(0, off, n).view(shape), self.scales[i]))

    def release(self) -> None:
        """Free the fp8 buffer; the weights no longer compute from it."""
        for p in self.flat.params:
            if hasattr(p, self.attribute):
                delattr(p, self.attribute)
        if self.held:
            self.full.untyped_storage().resize_(0)
            self.held = False


def attach_fp8_gathers(flats: list[FlatParamGroup], fp8_group: str, wire: torch.dtype) -> list[Fp8Scales]:
    """Give every stage-3 flat of the fp8 role gathered in `wire` its `Fp8FlatGather`, one
    `Fp8Scales` per shard group. Returns the scale tables (one amax all-reduce each per step)."""
    tables: dict[tuple[int, ...], Fp8Scales] = {}
    for flat in flats:
        if flat.role.name != fp8_group or flat.role.gather_dtype != wire or not flat.params_sharded:
            continue
        group = flat.spec.shard
        table = tables.setdefault(group.ranks, Fp8Scales(group))
        flat.fp8 = Fp8FlatGather(flat, table)
    return list(tables.values())
