"""ShardedMuon: Muon over the engine's flat master tensors, each matrix orthogonalized by its
owner rank (see [Note: Muon in zeroshard] in optimizer.py)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from zeroshard.monitor.timers import timed
from zeroshard.optim.muon.blocks import BlockLayout, param_block_layout
from zeroshard.optim.muon.maths import (
    adamw_group_step,
    apply_update,
    compute_dtype_of,
    fill_group_defaults,
    momentum_direction,
)
from zeroshard.optim.muon.newton_schulz import CompilableNewtonSchulz, ns_input_dtype, update_scale
from zeroshard.optim.muon.settings import parse_muon_params
from zeroshard.sharding.gather import GatherPiece, all_gather_shards
from zeroshard.sharding.ranges import overlap

if TYPE_CHECKING:
    from zeroshard.sharding.flat import FlatParamGroup


def assign_owners(costs: Sequence[int], world_size: int) -> list[int]:
    """Owner rank per task, balancing total cost (largest first onto the least-loaded rank).

    Deterministic (ties go to the lower index and the lower rank), so every rank computes
    the same assignment without communicating.
    """
    loads = [0] * world_size
    owners = [0] * len(costs)
    for index in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        owners[index] = rank
        loads[rank] += costs[index]
    return owners


@dataclass(frozen=True)
class _MatrixTask:
    """One contiguous region of a Muon flat orthogonalized as `blocks` matrices rows x cols
    (one, or a column-split parameter's heads, see [Note: Muon blocks] in blocks.py): where it
    lives, who orthogonalizes it, where its O is packed."""

    name: str
    flat_offset: int  # first element in the full flat buffer
    rows: int
    cols: int
    scale: float  # per block
    owner: int
    pack_offset: int  # first element in its owner's packed buffer
    blocks: int = 1
    axis: int = 0  # 1: column blocks, interleaved in the region

    @property
    def numel(self) -> int:
        return self.blocks * self.rows * self.cols

    @property
    def layout(self) -> BlockLayout:
        return BlockLayout(self.blocks, self.rows, self.cols, self.axis)

    def labels(self) -> list[str]:
        """One name per Newton-Schulz matrix."""
        return [self.name] if self.blocks == 1 else [f"{self.name}[{h}]" for h in range(self.blocks)]


@dataclass(frozen=True)
class _MuonLayout:
    flat: FlatParamGroup
    tasks: tuple[_MatrixTask, ...]
    pack_numel: int  # elements of every rank's packed buffer (the largest owner's load)


def _muon_layout(flat: FlatParamGroup) -> _MuonLayout:
    pieces = []  # (label, offset, rows, cols, blocks, axis)
    for name, p, shape, offset in zip(flat.names, flat.params, flat.shapes, flat.offsets, strict=True):
        if len(shape) < 2 or math.prod(shape) == 0:
            raise ValueError(
                f"parameter {name!r} (shape {tuple(shape)}) is in a Muon optimizer group, but Muon "
                "updates whole matrices. Give it use_muon=False (split_param_groups does)."
            )
        blocks = param_block_layout(name, p, shape)
        if blocks.axis == 1:  # interleaved column blocks: one task, batched over its heads
            pieces.append((name, offset, blocks.rows, blocks.cols, blocks.count, 1))
            continue
        for e in range(blocks.count):
            label = name if blocks.count == 1 else f"{name}[{e}]"
            pieces.append((label, offset + e * blocks.rows * blocks.cols, blocks.rows, blocks.cols, 1, 0))
    # Balanced by Newton-Schulz work, counted per block.
    costs = [n * r * c * min(r, c) for _, _, r, c, n, _ in pieces]
    owners = assign_owners(costs, flat.shard_size)  # ranks of the shard group
    loads = [0] * flat.shard_size
    tasks = []
    for (label, offset, rows, cols, n, axis), owner in zip(pieces, owners, strict=True):
        task = _MatrixTask(label, offset, rows, cols, update_scale(rows, cols), owner, loads[owner], n, axis)
        tasks.append(task)
        loads[owner] += task.numel
    return _MuonLayout(flat, tuple(tasks), max(loads))


def _gather_over_shard_group(
    flat: FlatParamGroup, source: torch.Tensor, target: torch.Tensor, wire_dtype: torch.dtype | None = None
) -> None:
    all_gather_shards([GatherPiece(source, target)], group=flat.spec.shard, tag="muon", wire_dtype=wire_dtype).wait()


class ShardedMuon(CompilableNewtonSchulz, torch.optim.Optimizer):
    """Muon over the engine's flat master tensors (see [Note: Muon in zeroshard]).

    Args:
        groups: optimizer groups over master tensors, each with "use_muon" and its kind's
            hyper-parameters (`split_param_groups` makes them; missing ones take defaults).
        flats: the engine's flat buffers; may be given later with `attach_flats`, before the
            first step.
        state_dtype: dtype of the momentum and moments when the precision plan wants it
            other than the masters' (bf16 masters, fp32 state); arithmetic is fp32 either way.
    """

    def __init__(
        self, groups: list[dict[str, Any]], flats: Sequence[FlatParamGroup] | None = None,
        state_dtype: torch.dtype | None = None,
    ) -> None:
        groups = [dict(g) for g in groups]
        for group in groups:
            fill_group_defaults(group)
        super().__init__(groups, {})
        self.state_dtype = state_dtype
        self.qk_clip: Any = None  # MuonClip's QKClip (optim/muon/qk_clip/), run after each step
        # gather(flat, source, target, wire_dtype=None): every rank's `source` into `target` over
        # the flat's shard group. The memory prediction replays the step with one that moves
        # nothing (zeroshard/memory/replay_step.py).
        self.gather = _gather_over_shard_group
        self._layouts: dict[int, _MuonLayout] = {}
        # Matrices of one shape are orthogonalized in one batched call. False (the deterministic
        # reduction): one call per matrix task, so each matrix meets the same kernels whatever
        # the world size (which tasks a rank owns, hence its batches, depends on it).
        self.batch_across_tasks = True
        if flats is not None:
            self.attach_flats(flats)

    def attach_flats(self, flats: Sequence[FlatParamGroup]) -> None:
        """Learn which matrices each Muon master holds, and their owner ranks."""
        by_master = {id(f.master): f for f in flats}
        layouts = {}
        for group in self.param_groups:
            for p in group["params"]:
                flat = by_master.get(id(p))
                if flat is None or flat.master is not p:
                    raise ValueError("ShardedMuon: a parameter is not the master tensor of any given flat buffer.")
                if group["use_muon"]:
                    layouts[id(p)] = _muon_layout(flat)
        self._layouts = layouts

    def owner_of(self) -> dict[str, int]:
        """Newton-Schulz matrix (a parameter, an expert `name[e]` or a head block `name[h]`)
        -> owner rank, over every Muon master (for tests and `explain`)."""
        return {label: t.owner for layout in self._layouts.values() for t in layout.tasks for label in t.labels()}

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001 - torch's signature
        """One Muon/AdamW step on every master; a collective at world size > 1 (all ranks
        call it together, as the engine does)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    raise RuntimeError(
                        "ShardedMuon.step: a master tensor has no gradient; the engine sets every "
                        "master's gradient (zeros for unused parameters) before stepping."
                    )
            if not group["use_muon"]:
                params = list(group["params"])
                adamw_group_step(params, [self.state[p] for p in params], group, self.state_dtype)
                continue
            for p in group["params"]:
                self._muon_step(p, group)
        if self.qk_clip is not None:
            self.qk_clip.apply()
        return loss

    def _muon_step(self, p: torch.Tensor, group: dict[str, Any]) -> None:
        layout = self._layouts.get(id(p))
        if layout is None:
            raise RuntimeError("ShardedMuon: call attach_flats(engine.flats) before the first step.")
        flat = layout.flat
        u = momentum_direction(p.grad, self.state[p], group, self.state_dtype)
        compute_dtype = compute_dtype_of(group, p)
        master_start, master_numel = flat.master_range()
        if master_numel == flat.padded_numel:
            full_u = u
        else:
            wire = ns_input_dtype(compute_dtype, u.dtype)  # never fp16 before normalising
            full_u = torch.empty(flat.padded_numel, dtype=wire, device=u.device)
            self.gather(flat, u, full_u, wire)

        packed = torch.zeros(layout.pack_numel, dtype=compute_dtype, device=p.device)
        mine: dict[tuple[int, int], list[_MatrixTask]] = {}
        for task in layout.tasks:
            if task.owner == flat.shard_rank:
                key = (task.rows, task.cols) if self.batch_across_tasks else (task.name,)
                mine.setdefault(key, []).append(task)
        for tasks in mine.values():
            batch = torch.cat([t.layout.to_blocks(full_u.narrow(0, t.flat_offset, t.numel)) for t in tasks])
            with timed("newton_schulz"):  # a Muon figure (zeroshard/monitor/timers.py)
                result = self.orthogonalize(batch, group["ns_steps"], group["ns_method"], compute_dtype)
            for t, o in zip(tasks, result.split([t.blocks for t in tasks]), strict=True):
                packed.narrow(0, t.pack_offset, t.numel).copy_(t.layout.from_blocks(o))
        if flat.shard_size > 1:
            every = torch.empty(flat.shard_size * layout.pack_numel, dtype=compute_dtype, device=p.device)
            self.gather(flat, packed, every)
        else:
            every = packed

        update = torch.zeros_like(u)
        for t in layout.tasks:  # the part of each O that falls in this rank's master range
            common = overlap(t.flat_offset, t.flat_offset + t.numel, master_start, master_start + master_numel)
            if common is None:
                continue
            lo, hi = common
            source = every.narrow(0, t.owner * layout.pack_numel + t.pack_offset + lo - t.flat_offset, hi - lo)
            target = update.narrow(0, lo - master_start, hi - lo)
            target.copy_(source)
            if t.scale != 1.0:
                target.mul_(t.scale)
        apply_update(p, update, group)


def build_muon(
    params_cfg: Mapping[str, Any] | None, groups: list[dict[str, Any]], flats: Sequence[FlatParamGroup],
    state_dtype: torch.dtype | None = None,
) -> ShardedMuon:
    """The engine's Muon: `groups` (from `split_param_groups`, "params" = master tensors)
    over `flats`. `params_cfg` is validated again so a direct caller gets the same errors."""
    parse_muon_params(params_cfg)
    return ShardedMuon(groups, flats, state_dtype)

