"""The optimizer step: from the reduced gradient to updated module parameters.

One owner for: cast the reduced gradient to the master dtype, unscale it (fp16), the global
norm over every flat's shard, the overflow decision (agreed by every rank through the
norm's all-reduce), clipping, the optimizer step, publishing the new masters into the
module parameters, the scheduler step, and clearing the gradients.

[Note: where masters and optimizer state live]
The home of the master weights and the optimizer state is decided here, once, from the
flats' sharding specs (`ShardingSpec.placement`). With "host" (ZeRO-Offload,
zeroshard/sharding/offload.py) the reduced gradient, cast to the master dtype where it was reduced,
lands in a host buffer before the unscale and the norm; the optimizer steps the host
masters and `publish_masters` brings them back in the parameter dtype.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from zeroshard.comm import collectives as comm
from zeroshard.comm import faults, simulated
from zeroshard.grads.tree_reduce import NORM_BLOCK_NUMEL, block_square_sums, pairwise_sum
from zeroshard.precision.loss_scale import LossScaler
from zeroshard.sharding.flat import FlatParamGroup
from zeroshard.sharding.layout import PLACEMENTS, ParallelLayout
from zeroshard.sharding.offload import HostGradients
from zeroshard.step.publish import publish_masters

_EXACT = 2**24


@dataclass(frozen=True)
class StepResult:
    """What one step did: the pre-clip norm, the norm after clipping (both device scalars, read
    on the host only when asked: `norm`, `post_clip_norm`), whether it was skipped (non-finite
    gradient), the loss scale it ran with, and the ranks whose own (unreduced) gradient was not
    finite."""

    norm_tensor: torch.Tensor
    post_clip_tensor: torch.Tensor
    overflow: bool
    scale: float
    nonfinite_ranks: tuple[int, ...] = ()
    finite: bool = True  # whether the global norm was finite (read once, in global_norm)

    @property
    def norm(self) -> float:
        return float(self.norm_tensor)  # a host sync: only when someone reads it

    @property
    def post_clip_norm(self) -> float:
        return float(self.post_clip_tensor)


def resolve_placement(flats: list[FlatParamGroup]) -> str:
    """Where the masters and optimizer state live: the one placement every flat's spec names."""
    placements = {flat.spec.placement for flat in flats} or {"device"}
    if len(placements) != 1 or not placements <= set(PLACEMENTS):
        raise ValueError(f"master placements {sorted(placements)}: one of {PLACEMENTS} for every flat is supported.")
    return placements.pop()


class OptimizerStep:
    """Steps the optimizer on the flats' masters (a collective: every rank calls `run`).

    Args:
        flats: every flat, in the engine's order.
        layout: the parallel layout (the norm is summed over its world).
        check_overflow: skip the step on a non-finite norm (the precision plan says when).
        loss_scaler: the loss scale to unscale by, updated after each step.
        clip: gradient_clipping (0: none).
        publish_bucket_numel: allgather_bucket_size for stage 1-2 publishing.
        device: where a norm of no flats lives.
        is_final: whether the running backward ends the accumulation (offload lands each
            reduced bucket on the host then: zeroshard/sharding/offload.py's HostGradients).
    """

    def __init__(
        self,
        flats: list[FlatParamGroup],
        layout: ParallelLayout,
        check_overflow: bool,
        loss_scaler: LossScaler,
        clip: float | None,
        publish_bucket_numel: int,
        device: torch.device,
        is_final: Callable[[], bool] | None = None,
        deterministic: bool = False,
    ) -> None:
        self.flats = flats
        self.deterministic = deterministic
        self.layout = layout
        self.check_overflow = check_overflow
        self.loss_scaler = loss_scaler
        self.clip = clip
        self.publish_bucket_numel = publish_bucket_numel
        self.device = device
        self.placement = resolve_placement(flats)
        self.host_grads = HostGradients(is_final) if self.placement == "host" else None
        self._optimizer: Any = None
        self.lr_scheduler: Any = None
        # Preemption (zeroshard/checkpoint/preempt.py): this rank's vote to stop rides in the
        # norm's all-reduce; `stop_agreed` is the world's answer, the same on every rank.
        self.stop_vote: Callable[[], bool] = lambda: False
        self.stop_agreed = False

    @property
    def optimizer(self) -> Any:
        return self._optimizer

    @optimizer.setter
    def optimizer(self, value: Any) -> None:
        self._optimizer = value
        _mark_overflow(value, False)

    def run(self, local_grad_sum: torch.Tensor | None = None, position: tuple[int, int] = (0, 0)) -> StepResult:
        """One step on the reduced gradients; skipped (parameters, optimizer state and
        scheduler untouched) if the global norm is not finite and the plan checks overflow.

        `local_grad_sum` is the sum of this rank's own gradients before reduction (the
        reducer's `take_local_sum`): whether it is finite travels with the norm, so the
        result names the rank(s) a non-finite gradient came from. `position` (this rank's step
        counter and its training forwards since the last step) travels with it too: ranks
        that disagree raise RankDesyncError on every rank, before anything is changed.

        [Note: host reads in a step]
        The norm, the clip coefficient and the clipping stay on the device: the coefficient is
        `clamp(clip / (norm + 1e-6), max=1)` (torch.nn.utils.clip_grad_norm_'s formula), and
        every gradient is multiplied by it (by 1.0, exactly, when the norm is below the clip).
        The norm reaches the host only when read (`StepResult.norm`,
        `engine.get_global_grad_norm()`, the log line every steps_per_print). The one host read
        per step is the packed all-reduce's result (`global_norm`): whether the norm is finite,
        which ranks produced a non-finite gradient and whether every rank is at the same step;
        skipping the optimizer, the scheduler and the loss-scale update are host decisions.
        """
        # The scale the backward used: the update comes after the step. DeepSpeed updates first
        # and so halves the gradient on a step that doubles the scale (the migration guide's
        # "fp16: unscaled by the scale the backward used").
        scale = self.loss_scaler.scale
        grads = []
        for flat in self.flats:
            landed = self.host_grads.take(flat) if self.host_grads is not None else None
            grad = landed if landed is not None else flat.grads.reduced_buffer()
            if grad.dtype != flat.master.dtype:
                grad = grad.to(flat.master.dtype)
            if self.host_grads is not None and landed is None:  # cast on the device first, then move it
                grad = self.host_grads.receive(id(flat), grad, flat.spec.pin_memory)
            flat.master.grad = grad
            grads.append(grad)
        if scale != 1.0 and grads:
            torch._foreach_mul_(grads, 1.0 / scale)

        norm, finite, nonfinite_ranks = self.global_norm(local_grad_sum, position)
        overflow = self.check_overflow and not finite
        if overflow:
            post_clip = norm
        else:
            post_clip = norm
            if self.clip and self.clip > 0:
                coef = torch.clamp(self.clip / (norm + 1e-6), max=1.0)
                for where, group in _by_device(grads).items():
                    # A foreach scalar tensor must be on its tensors' device. Under offload the
                    # gradients are on the host and the norm on the device: the host step needs
                    # the coefficient on the host, and this device-to-host read is inherent to a
                    # host step (the CPU clips and steps right after). On the device: no copy.
                    torch._foreach_mul_(group, coef.to(where))
                post_clip = norm * coef
            self.optimizer.step()
            publish_masters(self.flats, self.publish_bucket_numel)
            if self.lr_scheduler is not None:
                self.lr_scheduler.step()
        _mark_overflow(self.optimizer, overflow)
        self.loss_scaler.update(overflow)
        for flat in self.flats:
            flat.master.grad = None
            flat.grads.clear_reduced()
        return StepResult(norm, post_clip, overflow, scale, nonfinite_ranks, finite)

    def global_norm(
        self, local_grad_sum: torch.Tensor | None = None, position: tuple[int, int] = (0, 0)
    ) -> tuple[torch.Tensor, bool, tuple[int, ...]]:
        """L2 norm of the whole reduced, unscaled gradient, summed shard by shard (a 0-d fp32
        tensor on the device), whether it is finite, and the ranks whose local gradient sum
        (`local_grad_sum`) was not finite.

        [Note: what travels with the norm]
        One all-reduce (a sum over the world) of [norm partial, one slot per rank]: each rank
        writes 1.0 into its own slot when its own gradient was not finite, so every rank
        learns which ranks produced a NaN or inf (after the reduction every rank's shard may
        hold it) without a second collective. Two more slots per rank carry its position (step
        counter, training forwards since the last step), checked by
        `faults.check_positions`: a rank that skipped part of a step is found within the step.
        The last slot counts the ranks asked to stop by a signal (preemption): every rank
        leaves the step knowing whether any rank was, at no extra collective.

        With the deterministic reduction the first slot stays zero and one slot follows per
        block of NORM_BLOCK_NUMEL elements of every flat, at a position fixed by the flat and the
        block: each rank writes its own blocks' sums of squares and leaves the others zero, so
        the all-reduce returns each block's sum whatever order it adds in (x + 0 == x). Every
        rank then sums them by the fixed tree ([Note: the deterministic reduction] in
        zeroshard/grads/tree_reduce.py): the norm has the same bits at every world size.

        Every stage sums the same per-shard partial sums in the same order, so the norm
        (and hence clipping) is bitwise identical across stages. A flat replicated over R
        ranks contributes 1/R of its partial on each (zeroshard/sharding/layout.py's note), so every
        tensor counts once in the world's sum.
        """
        world = self.layout.world
        size = world.size
        base = 2 + 3 * size  # the first block slot of the deterministic norm
        blocks = self._block_slots() if self.deterministic else []
        # On the device even when the partials are on the host (offload): the wire's device.
        packed = torch.zeros(base + sum(count for _, _, count in blocks), dtype=torch.float32, device=self.device)
        if self.deterministic:
            for flat, start, count in blocks:
                per_rank = count // flat.shard_size
                first = base + start + flat.shard_rank * per_rank
                packed[first : first + per_rank] = block_square_sums(self._grad_shard(flat)).to(self.device)
        else:
            packed[0] = self._shard_partials().to(device=self.device, dtype=torch.float32)
        if local_grad_sum is not None:
            packed[1 + world.rank] = (~torch.isfinite(local_grad_sum.to(packed.device))).float()
        # fp32 holds integers exactly below 2**24: counters modulo that still differ when
        # ranks are a few steps apart. fill_ passes the number to the kernel as an argument;
        # assigning a Python number (`packed[i] = n`) would copy it from pageable host memory,
        # which waits for the device.
        packed[1 + size + world.rank].fill_(position[0] % _EXACT)
        packed[1 + 2 * size + world.rank].fill_(position[1] % _EXACT)
        if self.stop_vote():  # the last slot: how many ranks were asked to stop (preempt.py)
            packed[1 + 3 * size].fill_(1.0)
        own = packed.clone() if simulated.is_simulated(world) else None
        comm.all_reduce(packed, group=world, tag="norm")
        if own is not None:
            packed = _peers_stand_in(packed, own, world)
        if blocks:
            # Each flat's blocks by the tree over block index, then the flats by the tree.
            sums = [pairwise_sum(packed[base + start : base + start + count]) for _, start, count in blocks]
            packed[0] = pairwise_sum(torch.stack(sums))
        packed = packed[:base]
        # The step's one host read (see run's note; docs/gpu-streams.md). The GPU check's
        # host-sync row allows exactly this one per step (benchmarks/gpu_check/syncs.py).
        values = packed.tolist()
        norm = packed[0].sqrt()  # the float32 square root, as the norm always was
        finite = math.isfinite(values[0])
        values = values[1:]
        self.stop_agreed = self.stop_agreed or values[3 * size] > 0
        faults.check_positions(world.ranks, values[size : 2 * size], values[2 * size : 3 * size])
        flags = values[:size]
        return norm, finite, tuple(world.ranks[i] for i, flag in enumerate(flags) if flag != 0)

    @staticmethod
    def _grad_shard(flat: FlatParamGroup) -> torch.Tensor:
        grad = flat.master.grad
        return grad if flat.policy.shard_optimizer else flat.shard_of(grad)

    def _shard_partials(self) -> torch.Tensor:
        """This rank's sum of squares over its shards (a flat replicated R times counts 1/R)."""
        partials = []
        for flat in self.flats:
            partial = self._grad_shard(flat).float().pow(2).sum()
            if flat.spec.copies > 1:
                partial = partial / flat.spec.copies
            partials.append(partial)
        return torch.stack(partials).sum() if partials else torch.zeros((), device=self.device)

    def _block_slots(self) -> list[tuple[FlatParamGroup, int, int]]:
        """(flat, first slot, slots) of every flat's NORM_BLOCK_NUMEL-element blocks, in flat order."""
        slots, start = [], 0
        for flat in self.flats:
            count = flat.padded_numel // NORM_BLOCK_NUMEL
            slots.append((flat, start, count))
            start += count
        return slots


def _peers_stand_in(packed: torch.Tensor, own: torch.Tensor, world: comm.Group) -> torch.Tensor:
    """The packed all-reduce's answer in a simulated world, where no peer exists
    (zeroshard/comm/simulated.py's note): every rank reported this rank's step and position
    (so the desync check compares this rank with itself), only this rank is named when its
    gradient is not finite (the others were never computed), and the norm and the stop count
    are the backend's stand-in sum (every rank a replica of this one)."""
    size = world.size
    answer = packed.clone()
    answer[1 : 1 + size].zero_()
    answer[1 + world.rank] = own[1 + world.rank]
    for base in (1 + size, 1 + 2 * size):
        answer[base : base + size] = own[base + world.rank]
    return answer


def _by_device(tensors: list[torch.Tensor]) -> dict[torch.device, list[torch.Tensor]]:
    """`tensors` grouped by device, in order (one foreach call per device)."""
    groups: dict[torch.device, list[torch.Tensor]] = {}
    for tensor in tensors:
        groups.setdefault(tensor.device, []).append(tensor)
    return groups


def _mark_overflow(optimizer: Any, overflow: bool) -> None:
    """`optimizer.overflow`: whether the last step was skipped, as DeepSpeed's ZeRO and fp16
    optimizers say it. Accelerate reads it (`accelerator.optimizer_step_was_skipped`, which the
    Hugging Face Trainer asks after every step) and looks for it when it wraps the optimizer,
    before any step, so it exists from the moment the engine holds the optimizer."""
    if optimizer is None:
        return
    try:
        optimizer.overflow = bool(overflow)
    except (AttributeError, TypeError):  # an optimizer with __slots__ or a read-only property
        pass
