"""DeepSpeed's ZeRO-3 parameter attributes on a stage-3 engine's parameters.

DeepSpeed 0.19.8 (runtime/zero/partition_parameters.py `_convert_to_deepspeed_param`) gives every
parameter it partitions a `ds_id`, and code tells a ZeRO-3 parameter apart by
`hasattr(p, "ds_id")` before it reads `ds_shape` or `ds_numel` (DeepSpeed's own
`runtime.zero.utils.is_zero_param`, its tensor-fragment helpers, scripts that size a model). The
ones zeroshard gives, with DeepSpeed's meaning:

- `ds_id`: a unique integer, the same on every rank; one counter per process, as DeepSpeed's
  `Init.param_id`. A parameter built under `zeroshard.zero.Init` gets it there (DeepSpeed's
  order: construction); the others when a stage-3 engine adopts them (`parameters()` order).
  Only trainable parameters a stage-3 engine shards or keeps resident have one: a frozen
  parameter stays whole on every rank and reads as an ordinary tensor.
- `ds_persist`: the parameter stays gathered through training, because its unit is below
  `stage3_param_persistence_threshold` (zeroshard decides per unit, DeepSpeed per parameter).
- `partition_numel()`: how many of the parameter's elements this rank holds. zeroshard's shard is a
  slice of the unit's flat buffer, so ranks hold different counts (0 up to the whole
  parameter, summing to `ds_numel` over the ranks); DeepSpeed's partitions are ceil(numel / W)
  on every rank, padding included.
- `ds_summary(use_debug_name=False)`: DeepSpeed's dict, same keys; "ds_tensor.shape" is the shape
  of this rank's part, `(partition_numel(),)`.

`ds_shape`, `ds_numel` and `ds_status` are set by the flat buffers (zeroshard/sharding/flat.py,
at every stage) and `ds_active_sub_modules` by engine/parameter_offload.py. `ds_tensor` is
absent on an engine's parameters: this rank's part is a slice of the unit's flat buffer, which at
bf16 or fp16 often exists only as the fp32 master (docs/design.md section 3), so there is no
16-bit partition tensor to hand out without a copy; `zeroshard.utils.safe_get_local_fp32_param`
gives this rank's part. (Under `Init`, before `initialize`, `ds_tensor` is the partition.)
"""

from __future__ import annotations

import itertools
import types
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

__all__ = ["DS_SUMMARY_KEYS", "assign_ds_id", "mark_stage3"]

# DeepSpeed 0.19.8's ds_summary() keys, in its order.
DS_SUMMARY_KEYS = ("id", "status", "numel", "ds_numel", "shape", "ds_shape", "requires_grad", "grad_shape",
                   "persist", "active_sub_modules", "ds_tensor.shape")

_NEXT_ID = itertools.count()


def assign_ds_id(p: nn.Parameter) -> int:
    """`p.ds_id`, assigned from the process's counter if `p` has none yet."""
    if not hasattr(p, "ds_id"):
        p.ds_id = next(_NEXT_ID)
    return p.ds_id


def _ds_summary(p: nn.Parameter, name: str, use_debug_name: bool = False) -> dict[str, Any]:
    return {
        "id": f"name={name} id={p.ds_id}" if use_debug_name else p.ds_id,
        "status": p.ds_status.name,
        "numel": p.numel(),
        "ds_numel": p.ds_numel,
        "shape": tuple(p.shape),
        "ds_shape": tuple(p.ds_shape),
        "requires_grad": p.requires_grad,
        "grad_shape": tuple(p.grad.shape) if p.grad is not None else None,
        "persist": p.ds_persist,
        "active_sub_modules": getattr(p, "ds_active_sub_modules", set()),
        "ds_tensor.shape": torch.Size([p.partition_numel()]),
    }


def mark_stage3(module: nn.Module, flats: Iterable[Any], stage3: bool) -> None:
    """Give every parameter of a stage-3 engine's flat buffers DeepSpeed's ZeRO-3 attributes
    (module docstring); ids in `module.parameters()` order, the same on every rank. Parameters the
    engine keeps whole (frozen ones, or all of them below stage 3) lose an id `Init` gave them:
    they read as ordinary tensors."""
    flats = list(flats) if stage3 else []
    managed = {id(p) for flat in flats for p in flat.params}
    for p in module.parameters():
        if id(p) in managed:
            assign_ds_id(p)
        elif hasattr(p, "ds_id"):
            del p.ds_id
    for flat in flats:
        resident = flat.policy.keep_full_params
        for index, (name, p) in enumerate(zip(flat.names, flat.params, strict=True)):
            p.ds_persist = resident

            def partition_numel(flat=flat, index=index) -> int:
                held = flat.param_range_in_shard(index)
                return 0 if held is None else held[2]

            p.partition_numel = partition_numel
            p.ds_summary = types.MethodType(lambda self, use_debug_name=False, n=name: _ds_summary(
                self, n, use_debug_name), p)
