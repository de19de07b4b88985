"""ZeRO-Offload: master weights and optimizer state (and at stage 3 the parameter shards) in
host memory, the optimizer stepped by the CPU.

[Note: where offload attaches]
* Placement is part of each flat's `ShardingSpec` (zeroshard/layout.py): `placement` for the
  master weights and optimizer state, `param_placement` for stage 3's parameter shard;
  `place_layout` sets them once from the config. A "host" master is always its own host
  copy (also when the plan says the masters are the parameters), so on a CPU-only machine
  every numerical path of offload still runs: the host copy is a separate CPU tensor.
* The gradient path is untouched: every backward of a step (several per step with
  accumulation 1, accumulation > 1, no_sync) accumulates into the same device buffers as
  without offload, and only the reduced shard of the whole step crosses to the host, once,
  at the boundary (`HostGradients.receive`, cast to the master dtype on the device first).
  So no backward's gradient can be dropped (DeepSpeed's offload bug gated its host
  accumulation on gradient_accumulation_steps > 1), and a step with one backward allocates
  no host accumulator: only the one landing buffer per flat, reused every step.
* The optimizer steps the host masters once per logical step (zeroshard/step.py); Adam and
  AdamW use torch's fused CPU kernel (`zeroshard.ops.adam.DeepSpeedCPUAdam`). Publishing
  copies the updated master back in the parameter dtype: the one all-gather
  (zeroshard/gather.py) packs host sources into device buckets, and stage 3 copies into the
  parameter shard.
* Checkpoints store masters and optimizer state as fragments whatever their placement, so a
  checkpoint moves between offloaded and non-offloaded engines and world sizes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from .layout import ParallelLayout

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
    """The host buffers the reduced gradient shards land in at each boundary, one per flat,
    allocated at the first step and reused (pinned when the spec asks)."""

    def __init__(self) -> None:
        self._buffers: dict[int, torch.Tensor] = {}

    def receive(self, key: int, grad: torch.Tensor, pin: bool) -> torch.Tensor:
        """Copy `grad` (already in the master dtype) into flat `key`'s host buffer."""
        buf = self._buffers.get(key)
        if buf is None or buf.numel() != grad.numel() or buf.dtype != grad.dtype:
            buf = torch.empty(grad.numel(), dtype=grad.dtype, device=HOST, pin_memory=pin)
            self._buffers[key] = buf
        # Blocking: the CPU reads it right away (unscale, norm, the host optimizer step).
        buf.copy_(grad.reshape(-1))
        return buf

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())


def build_host_optimizer(
    opt_type: str, params: dict[str, Any], groups: list[dict[str, Any]], state_dtype: torch.dtype | None
) -> torch.optim.Optimizer:
    """The config's optimizer over host masters: Adam/AdamW as the fused CPU kernel
    (DeepSpeedCPUAdam), anything else as `build_optimizer` makes it."""
    from .ops.adam import DeepSpeedCPUAdam
    from .optim.build import build_optimizer

    built = build_optimizer(opt_type, params, groups, state_dtype)  # validates the parameters
    if type(built) not in (torch.optim.Adam, torch.optim.AdamW):
        return built
    d = built.defaults
    return DeepSpeedCPUAdam(
        groups, lr=d["lr"], betas=d["betas"], eps=d["eps"], weight_decay=d["weight_decay"],
        amsgrad=d["amsgrad"], adamw_mode=bool(d.get("decoupled_weight_decay", type(built) is torch.optim.AdamW)),
    )
