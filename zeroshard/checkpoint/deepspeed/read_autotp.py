"""Reading a DeepSpeed 0.19.8 AutoTP checkpoint (`mp_world_size` > 1) into a PortableState of
whole tensors.

Every file of a ZeRO checkpoint (read_ds.py's [Note: DeepSpeed's checkpoint layouts]) exists
once per tensor-parallel rank, `mp_rank_<t>`: each rank's model states and optimizer state
describe that rank's pieces. `read_tensor_rank` reads one rank's; the pieces are then joined by
the description DeepSpeed saves with the model states, `universal_checkpoint_info`:

- its affine map (`affine_map.params`, by parameter-name regex): for every tensor-parallel rank,
  the pieces it holds, each a strided view of the whole tensor (`source`: offset and strides in
  the logical shape) and of the rank's local tensor (`dest`); a piece held by several ranks
  (a whole parameter) lists them all. This describes column, row and packed sub-parameter
  splits alike, so it is what zeroshard follows;
- where a parameter has no map entry, the pattern lists: `tp_replicated_parameter_patterns`
  (tensor rank 0's copy), `parameter_with_row_parallelism_patterns` (pieces joined along dim 1),
  anything else along dim 0 (column);
- `autotp_unsupported_parameter_patterns` names parameters DeepSpeed itself cannot describe:
  refused by name.

Only elements move, so masters and moments come out bitwise the saved ones.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from zeroshard.checkpoint.base import CheckpointError
from zeroshard.checkpoint.deepspeed.portable import PortableState

__all__ = ["Joiner", "join_tensor_ranks", "whole_shapes_of"]


def _lookup(table: dict[str, Any], name: str) -> Any:
    """The entry of the first regex key of `table` that matches `name` (None: none does)."""
    for pattern, entry in table.items():
        if re.match(pattern, name):
            return entry
    return None


def _matches(patterns: list[str], name: str) -> bool:
    return any(re.match(pattern, name) for pattern in patterns)


class Joiner:
    """Joins one tensor's pieces, one per tensor-parallel rank, by `universal_checkpoint_info`."""

    def __init__(self, info: dict[str, Any], where: Path, parts: int) -> None:
        self.where, self.parts = where, parts
        self.maps = ((info.get("affine_map") or {}).get("params") or {})
        self.replicated = list(info.get("tp_replicated_parameter_patterns") or [])
        self.rows = list(info.get("parameter_with_row_parallelism_patterns") or [])
        self.unsupported = dict(info.get("autotp_unsupported_parameter_patterns") or {})

    def join(self, name: str, pieces: list[torch.Tensor]) -> torch.Tensor:
        reason = _lookup(self.unsupported, name)
        if reason is not None:
            raise CheckpointError(f"{self.where}: parameter {name} is one DeepSpeed marks as not convertible "
                                  f"({reason}); zeroshard cannot join its tensor-parallel pieces either.")
        entry = _lookup(self.maps, name)
        if entry is not None:
            return self._by_map(name, pieces, entry)
        if _matches(self.replicated, name):
            return pieces[0].clone()
        return torch.cat(pieces, dim=1 if _matches(self.rows, name) else 0)

    def _by_map(self, name: str, pieces: list[torch.Tensor], entry: dict[str, Any]) -> torch.Tensor:
        shape = [int(d) for d in entry["logical_shape"]]
        whole = pieces[0].new_empty(shape)
        covered = torch.zeros(shape, dtype=torch.bool)
        ranks = {int(k): v for k, v in entry["ranks"].items()}
        if sorted(ranks) != list(range(self.parts)):
            raise CheckpointError(f"{self.where}: the affine map of {name} describes tensor ranks {sorted(ranks)}, "
                                  f"the checkpoint has {self.parts}; the files do not belong together.")
        for rank, described in ranks.items():
            # A fresh contiguous copy: as_strided offsets count from the start of its storage.
            local = pieces[rank].contiguous().clone().reshape(-1)
            if list(pieces[rank].shape) != [int(d) for d in described["shard_shape"]]:
                raise CheckpointError(f"{self.where}: tensor rank {rank}'s piece of {name} has shape "
                                      f"{list(pieces[rank].shape)}, the affine map says {described['shard_shape']}.")
            for piece in described["pieces"]:
                size = [int(d) for d in piece["shape"]]
                (src_offset, src_strides), (dst_offset, dst_strides) = piece["source"], piece["dest"]
                whole.as_strided(size, src_strides, src_offset).copy_(local.as_strided(size, dst_strides, dst_offset))
                covered.as_strided(size, src_strides, src_offset).fill_(True)  # the same layout as `whole`
        if not bool(covered.all()):
            raise CheckpointError(f"{self.where}: the affine map of {name} leaves part of its {shape} elements "
                                  "uncovered; the checkpoint cannot be joined.")
        return whole


def whole_shapes_of(model: dict[str, Any]) -> dict[str, tuple[int, ...]] | None:
    """Every parameter's whole shape by name (the affine map's logical shapes) for an AutoTP
    checkpoint's model states; None without tensor parallelism."""
    info = model.get("universal_checkpoint_info")
    if int(model.get("mp_world_size", 1) or 1) == 1 or not isinstance(info, dict):
        return None
    maps = (info.get("affine_map") or {}).get("params") or {}
    out = {}
    for group in model.get("param_shapes") or []:
        for name in group:
            entry = _lookup(maps, name)
            if entry is not None:
                out[name] = tuple(int(d) for d in entry["logical_shape"])
    return out


def join_tensor_ranks(states: list[PortableState], model: dict[str, Any], where: Path) -> PortableState:
    """One state of whole tensors from every tensor rank's state (read_ds.read_tensor_rank), by the
    `universal_checkpoint_info` of tensor rank 0's model states `model` (read from `where`).

    Raises:
        CheckpointError: no description, ranks that disagree, a parameter DeepSpeed marks as not
            convertible, or pieces the description does not cover.
    """
    parts = len(states)
    info = model.get("universal_checkpoint_info")
    if not isinstance(info, dict):
        raise CheckpointError(f"{where}: mp_world_size={parts} but no universal_checkpoint_info: not an AutoTP "
                              "checkpoint of DeepSpeed 0.19 (Megatron-style tensor parallelism is not read).")
    first = states[0]
    for t, state in enumerate(states[1:], start=1):
        if state.groups != first.groups or state.stage != first.stage or state.world_size != first.world_size:
            raise CheckpointError(f"{where.parent}: tensor rank {t}'s files describe other parameters, stage or "
                                  "data-parallel size than tensor rank 0's; the files belong to different saves.")
    joiner = Joiner(info, where, parts)
    first.masters = {name: joiner.join(name, [s.masters[name] for s in states]) for name in first.names}
    first.optimizer_state = {
        name: {key: joiner.join(name, [s.optimizer_state[name][key] for s in states])
               for key in first.optimizer_state[name]}
        for name in first.names
    }
    first.frozen = {name: joiner.join(name, [s.frozen[name] for s in states]) for name in first.frozen}
    return first
