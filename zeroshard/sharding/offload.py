"""ZeRO-Offload: master weights and optimizer state (and at stage 3 the parameter shards) in
host memory, the optimizer stepped by the CPU.

[Note: where offload attaches]
* Placement is part of each flat's `ShardingSpec` (zeroshard/sharding/layout.py): `placement` for the
  master weights and optimizer state, `param_placement` for stage 3's parameter shard;
  `place_layout` sets them once from the config. A "host" master is always its own host
  copy (also when the plan says the masters are the parameters), so on a CPU-only machine
  every numerical path of offload still runs: the host copy is a separate CPU tensor.
* The gradient path is untouched: every backward of a step (several per step with
  accumulation 1, accumulation > 1, no_sync) accumulates into the same device buffers as
  without offload, and only the reduced shard of the whole step crosses to the host, once:
  bucket by bucket as the boundary backward's reductions complete (`HostGradients.land`),
  or whole at the step when something else changed it (`HostGradients.receive`), cast to
  the master dtype on the device first either way.
  So no backward's gradient can be dropped (DeepSpeed's offload bug gated its host
  accumulation on gradient_accumulation_steps > 1), and a step with one backward allocates
  no host accumulator: only the one landing buffer per flat, reused every step.
* The optimizer steps the host masters once per logical step (zeroshard/step/optimizer_step.py); Adam and
  AdamW use torch's fused CPU kernel (`zeroshard.ops.adam.DeepSpeedCPUAdam`). Publishing
  copies the updated master back in the parameter dtype: the one all-gather
  (zeroshard/sharding/gather.py) packs host sources into device buckets, and stage 3 copies into the
  parameter shard.
* Checkpoints store masters and optimizer state as fragments whatever their placement, so a
  checkpoint moves between offloaded and non-offloaded engines and world sizes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from zeroshard.sharding.layout import ParallelLayout

if TYPE_CHECKING:
    from zeroshard.sharding.flat import FlatParamGroup

HOST = torch.device("cpu")


@dataclass(frozen=True)
class OffloadPlan:
    """What the config offloads.

    Attributes:
        optimizer: master weights and optimizer state on the host (offload_optimizer).
        params: stage 3's parameter shards on the host (offload_param).
        pin: pin the host buffers (pin_memory), honoured when a GPU is present.
    """

    optimizer: bool = False
    params: bool = False
    pin: bool = False

    @classmethod
    def from_config(cls, zero: Any) -> OffloadPlan:
        return cls(zero.optimizer_offload, zero.param_offload, zero.offload_pin_memory)

    @property
    def pinned(self) -> bool:
        """Whether host buffers are actually pinned (pinning needs a GPU)."""
        return self.pin and torch.cuda.is_available()


def place_layout(layout: ParallelLayout, plan: OffloadPlan) -> ParallelLayout:
    """`layout` with its dense spec naming where masters/optimizer state and parameter shards live."""
    if not (plan.optimizer or plan.params):
        return layout
    dense = dataclasses.replace(
        layout.dense,
        placement="host" if plan.optimizer else "device",
        param_placement="host" if plan.params else "device",
        pin_memory=plan.pinned,
    )
    return dataclasses.replace(layout, dense=dense)


def host_copy(source: torch.Tensor, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """A new host tensor holding `source` in `dtype` (cast where `source` lives, then moved)."""
    out = torch.empty(source.shape, dtype=dtype, device=HOST, pin_memory=pin)
    out.copy_(source.detach().to(dtype))
    return out


class HostGradients:
    """The host buffers the reduced gradient shards land in, one per flat, allocated once and
    reused (pinned when the spec asks).

    [Note: landing bucket by bucket]
    In the backward that ends the accumulation (`is_final`), the reducer reports each piece of
    a reduced shard as soon as its bucket's reduction is written (`land`): the piece is cast
    to the master dtype where it was reduced and copied to the same elements of the host
    buffer, non-blocking from pinned memory on a GPU, so the copies run while the backward
    goes on. A later change to the same elements (a flat reduced twice in one backward)
    lands again; any other change resets `flat.grads.host_landed`, as a reduction outside the
    final backward does, and an in-place change (stage 1's `param.grad` views) shows in the
    tensor's version counter. At the step `take` returns the host buffer if every element
    landed since, and otherwise `receive` moves the whole shard as before. The cast and the
    copy are elementwise, so both ways give bitwise the same host gradient.
    """

    def __init__(self, is_final: Callable[[], bool] | None = None) -> None:
        self._buffers: dict[int, torch.Tensor] = {}
        self._copied: dict[int, torch.cuda.Event] = {}  # the last non-blocking copy per flat
        # The reduced gradient's version counter after the last landing, per flat: an in-place
        # change after it (a user editing stage 1's param.grad views, which share the counter)
        # makes the landed copy stale.
        self._versions: dict[int, int] = {}
        self._is_final = is_final
        self.moves = {"landed": 0, "whole": 0}  # flats moved each way at the steps so far (tests)

    def _buffer(self, key: int, numel: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
        buf = self._buffers.get(key)
        if buf is None or buf.numel() != numel or buf.dtype != dtype:
            buf = torch.empty(numel, dtype=dtype, device=HOST, pin_memory=pin)
            self._buffers[key] = buf
        return buf

    def land(self, flat: FlatParamGroup, start: int, end: int) -> None:
        """Elements [start, end) of `flat`'s reduced shard were just written."""
        if self._is_final is None or not self._is_final():
            flat.grads.host_landed = 0  # more accumulates before the step: land it then
            return
        reduced = flat.grads.reduced
        dtype = flat.master.dtype
        buf = self._buffer(id(flat), reduced.numel(), dtype, flat.spec.pin_memory)
        piece = reduced[start:end]
        if piece.dtype != dtype:
            piece = piece.to(dtype)  # cast on the device first, as `receive` does
        async_copy = piece.is_cuda and buf.is_pinned()
        buf[start:end].copy_(piece, non_blocking=async_copy)
        if async_copy:
            event = torch.cuda.Event()
            event.record()
            self._copied[id(flat)] = event
        flat.grads.host_landed += end - start
        self._versions[id(flat)] = reduced._version

    def take(self, flat: FlatParamGroup) -> torch.Tensor | None:
        """`flat`'s host gradient if all of it landed since it last changed, else None."""
        buf = self._buffers.get(id(flat))
        landed, flat.grads.host_landed = flat.grads.host_landed, 0
        if buf is None or flat.grads.reduced is None or landed < buf.numel() or buf.dtype != flat.master.dtype:
            return None
        if self._versions.get(id(flat)) != flat.grads.reduced._version:
            return None  # changed in place after it landed: move it whole
        event = self._copied.pop(id(flat), None)
        if event is not None:
            event.synchronize()  # the CPU reads it right away
        self.moves["landed"] += 1
        return buf

    def receive(self, key: int, grad: torch.Tensor, pin: bool) -> torch.Tensor:
        """Copy `grad` (already in the master dtype) into flat `key`'s host buffer."""
        buf = self._buffer(key, grad.numel(), grad.dtype, pin)
        self.moves["whole"] += 1
        # Blocking: the CPU reads it right away (unscale, norm, the host optimizer step).
        buf.copy_(grad.reshape(-1))
        return buf

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())
