"""Frozen parameters (no flat, no master: `requires_grad=False`) in checkpoints and exports.

The engine keeps no shards of a frozen parameter: each rank holds it as the module does. For a
dense one every rank holds the same whole tensor, but an expert parameter is a different
tensor on each expert-parallel rank, so rank 0 alone cannot write it:

* an expert of a DeepSpeed `MoE` layer: local expert j is global expert `ep_rank * L + j`
  (zeroshard/moe/utils.py); the checkpoint keys it by the global name, like a trained expert;
* an AutoEP stack [L, ...]: a contiguous block of the global [E, ...] stack
  (zeroshard/moe/autoep/layer.py); the checkpoint holds the global stack;
* a tensor-parallel piece (`p.tp_split`, zeroshard/autotp/split.py): the checkpoint holds the
  whole tensor, gathered over the tensor group.

So saving gathers them over each expert-parallel group (`frozen_state`, collective), and
loading takes each rank's part back out (`frozen_values`); the saved names and shapes are
then those of the ep_size 1 model (zeroshard/checkpoint/names.py), for any ep_size.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from zeroshard.autotp.split import tensor_split_of
from zeroshard.checkpoint.base import CheckpointError
from zeroshard.checkpoint.names import saved_offset
from zeroshard.comm import collectives as comm
from zeroshard.moe.utils import global_expert_names

__all__ = ["frozen_state", "frozen_values", "moe_expert_places", "whole_by_saved_name"]


def moe_expert_places(module: Any) -> dict[int, tuple[str, int, int, str, int]]:
    """id(local expert parameter of an MoE layer) -> (experts' name prefix, local experts per
    rank L, local index j, name inside the expert, ep_size)."""
    from zeroshard.moe.layer import MoE

    places = {}
    for prefix, layer in module.named_modules():
        if not isinstance(layer, MoE):
            continue
        base = f"{prefix}.deepspeed_moe.experts.deepspeed_experts." if prefix else (
            "deepspeed_moe.experts.deepspeed_experts."
        )
        for j, expert in enumerate(layer.deepspeed_moe.experts.deepspeed_experts):
            for rest, p in expert.named_parameters():
                places[id(p)] = (base, layer.num_local_experts, j, rest, layer.ep_size)
    return places


def _gather_over_expert_group(engine: Any, p: torch.Tensor, out_shape: tuple[int, ...]) -> torch.Tensor:
    """Every expert-parallel rank's `p`, concatenated in ep-rank order (groups are consecutive
    ranks, so a member's index in the group is its ep rank) and shaped `out_shape`."""
    group = engine.layout.expert_parallel[p.group_name]
    full = p.new_empty(out_shape)
    comm.all_gather(full, p.detach().contiguous(), group=group, tag="frozen")
    return full


def _gather_over_tensor_group(engine: Any, p: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a tensor-parallel piece: every rank's piece of its tensor group,
    assembled ([Note: tensor-parallel splits] in zeroshard/autotp/split.py)."""
    split = tensor_split_of(p)
    group = engine.layout.tensor
    pieces = p.new_empty((split.parts, *split.local_shape))
    comm.all_gather(pieces, p.detach().contiguous(), group=group, tag="export")
    return split.assemble(list(pieces.unbind(0)))


def whole_by_saved_name(
    engine: Any, name: str, p: torch.Tensor, places: dict[int, tuple[str, int, int, str, int]], keep: bool
) -> dict[str, torch.Tensor]:
    """Parameter `name` (`p` holding its full local value) by checkpoint name, whole, on the
    host: an expert of an MoE layer as every expert-parallel rank's copy under its global name,
    an AutoEP stack as the global stack, anything else as it is. A collective over the
    expert-parallel group for the first two; only with `keep` (the writer) are tensors returned.
    `places`: `moe_expert_places(engine.module)`."""
    out: dict[str, torch.Tensor] = {}
    if id(p) in places:
        base, per_rank, j, rest, ep_size = places[id(p)]
        full = _gather_over_expert_group(engine, p, (ep_size, *p.shape))
        if keep:
            for ep_rank in range(ep_size):
                out[f"{base}{ep_rank * per_rank + j}.{rest}"] = full[ep_rank].to("cpu", copy=True)
    elif hasattr(p, "autoep_global_shape"):
        full = _gather_over_expert_group(engine, p, tuple(p.autoep_global_shape))
        if keep:
            out[name] = full.to("cpu", copy=True)
    elif tensor_split_of(p) is not None:
        full = _gather_over_tensor_group(engine, p)
        if keep:
            out[name] = full.to("cpu", copy=True)
    elif keep:
        out[name] = p.detach().to("cpu", copy=True)
    return out


def frozen_state(engine: Any, frozen: list[str], keep: bool) -> dict[str, torch.Tensor]:
    """The frozen parameters `frozen` (the module's names, in `state_dict` order, as
    `save.module_names` lists them) by checkpoint name, whole, on the host: expert parameters
    gathered over their expert-parallel groups. Collective (every rank calls it with the same
    model); only a rank with `keep` (the writer) returns the tensors, the others {}.
    """
    params = dict(engine.module.named_parameters(remove_duplicate=False))
    places = moe_expert_places(engine.module)
    out: dict[str, torch.Tensor] = {}
    for name in frozen:
        out.update(whole_by_saved_name(engine, name, params[name], places, keep))
    return out


def frozen_values(
    module: Any, frozen: list[str], saved: Callable[[str], torch.Tensor | None]
) -> dict[str, torch.Tensor]:
    """The values to copy into this rank's frozen parameters `frozen` (module names):
    `saved(checkpoint name)` gives the saved whole tensor (None: not in the checkpoint); an
    expert takes its global expert's tensor, an AutoEP stack its block of the global stack.

    Raises:
        CheckpointError: a parameter missing from the checkpoint, or a saved tensor that does
            not hold this rank's part in the model's shape.
    """
    params = dict(module.named_parameters(remove_duplicate=False))
    experts = global_expert_names(module)
    out: dict[str, torch.Tensor] = {}
    for name in frozen:
        p = params[name]
        saved_name = experts.get(id(p), name)
        value = saved(saved_name)
        if value is None:
            raise CheckpointError(f"frozen parameter {saved_name} is not in the checkpoint.")
        split = tensor_split_of(p)
        if split is not None:  # a tensor-parallel piece: cut from the saved whole tensor
            if tuple(value.shape) != split.full_shape:
                raise CheckpointError(f"frozen parameter {saved_name}: saved shape {list(value.shape)}, the model's "
                                      f"whole shape is {list(split.full_shape)}.")
            out[name] = split.piece_of(value)
            continue
        shape = tuple(getattr(p, "ds_shape", p.shape))
        numel = 1
        for dim in shape:
            numel *= int(dim)
        start = saved_offset(p)
        stacked = hasattr(p, "autoep_global_shape")  # its block of the saved global stack
        if value.numel() < start + numel or (not stacked and tuple(value.shape) != shape):
            raise CheckpointError(
                f"frozen parameter {saved_name}: saved shape {list(value.shape)} does not hold this rank's "
                f"{list(shape)} (from element {start})."
            )
        out[name] = value.reshape(-1).narrow(0, start, numel).view(shape)
    return out
