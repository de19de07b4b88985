"""The optimizer step's allocations, replayed on fake tensors (step/optimizer_step.py, in order).

The optimizer itself is the real one (the config's, built by zeroshard.optim as the engine
builds it, over fake masters), so its temporaries are its own: torch's per-tensor AdamW on the
CPU keeps two master-sized temporaries of the largest flat, the fused CPU Adam of offload none,
Muon its gathered update, packed results and Newton-Schulz iterates. Around it, as the step
does: the reduced gradient cast to the master dtype where they differ (alive until the step
ends), the norm's per-flat temporaries, stages 1-2's publish all-gather buckets
(sharding/gather.py, two in flight), and what `clear_reduced` keeps or frees.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

from zeroshard.config.schema import ZeroshardConfig
from zeroshard.memory.replay import EngineReplay, ReplayFlat, Terms
from zeroshard.optim import build_optimizer as build_named_optimizer
from zeroshard.optim.build import build_host_optimizer
from zeroshard.optim.muon import optimizer as muon
from zeroshard.optim.state_dtype_adamw import StateDtypeAdamW
from zeroshard.precision.plan import PrecisionPlan
from zeroshard.sharding.gather import MAX_IN_FLIGHT

__all__ = ["StepReplay"]


def _replay_gather(flat: Any, source: torch.Tensor, target: torch.Tensor, wire_dtype: torch.dtype | None = None,
                   ) -> None:
    """ShardedMuon's gather, by sizes: all_gather_shards of one whole piece copies its source to
    the wire dtype and gathers straight into the target; nothing moves here."""
    source.to(dtype=wire_dtype or target.dtype, copy=True)


class _HostCounter(torch.Tensor):
    """A step counter read on the host: optim/foreach_adamw.py asks `float(step)`, which a fake
    tensor cannot answer (it has no value). This one answers 1.0 (the first step's) and takes
    the increment without a value (nothing else touches a counter)."""

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's signature
        if func is torch.ops.aten._foreach_add_.Scalar:
            return None
        raise NotImplementedError(f"a replayed step counter supports only the increment, not {func}")

    def __float__(self) -> float:
        return 1.0


def _host_step_counters(optimizer: Any, groups: list[dict[str, Any]]) -> None:
    """Give the foreach AdamW's `step` counters host values before its first step creates them."""
    with unset_fake_temporarily():
        for group in groups:
            for p in group["params"]:
                optimizer.state[p].setdefault("step", torch.Tensor._make_subclass(_HostCounter, torch.zeros(())))


class StepReplay:
    """Builds the config's optimizer over the replay's fake masters and replays one step."""

    def __init__(self, replay: EngineReplay, config: ZeroshardConfig, plan: PrecisionPlan, device_type: str) -> None:
        self.replay = replay
        self.config = config
        self.flats = replay.flat_list
        self.device_type = device_type
        self.optimizer = self._build(config, plan)
        self.host_step = any(f.shape.offload_optimizer for f in self.flats)

    def _build(self, config: ZeroshardConfig, plan: PrecisionPlan) -> Any:
        if config.optimizer is None:
            return None
        groups: dict[int, list[torch.Tensor]] = {}
        for flat in self.flats:
            groups.setdefault(flat.shape.optimizer_group, []).append(flat.master)
        param_groups = [{"params": groups[k], "use_muon": self._use_muon(k)} for k in sorted(groups)]
        states = {r.optimizer_state_dtype for r in plan.groups.values() if r.optimizer_state_dtype != r.master_dtype}
        state_dtype = next(iter(states)) if states else None
        params = dict(config.optimizer.params)
        if muon.is_muon_requested(None, config.optimizer):
            optimizer = muon.build_muon(params, param_groups, self.flats, state_dtype)
            optimizer.gather = _replay_gather
            _host_step_counters(optimizer, [g for g in optimizer.param_groups if not g["use_muon"]])
            return optimizer
        for group in param_groups:
            group.pop("use_muon")
        if any(f.shape.offload_optimizer for f in self.flats):
            return build_host_optimizer(config.optimizer.type, params, param_groups, state_dtype)
        if self.device_type != "cpu" and "fused" not in params and "foreach" not in params:
            # optim/build.py's fused_allowed: masters on an accelerator step with the fused kernel.
            if config.optimizer.type.lower() in ("adam", "adamw") and state_dtype is None:
                params["fused"] = True
        optimizer = build_named_optimizer(config.optimizer.type, params, param_groups, state_dtype)
        if isinstance(optimizer, StateDtypeAdamW):
            _host_step_counters(optimizer, optimizer.param_groups)
        return optimizer

    def _use_muon(self, group: int) -> bool:
        return any(f.shape.use_muon for f in self.flats if f.shape.optimizer_group == group)

    def run(self, warmup: bool = False) -> None:
        """One optimizer step (OptimizerStep.run), then what it leaves for the next forward. The
        warm-up step's allocations that live on are the optimizer's state."""
        replay, label = self.replay, self.replay.ledger.label
        grads = []
        step_label = Terms.HOST_STEP if self.host_step else Terms.STEP
        if warmup:
            step_label = Terms.HOST_OPTIMIZER_STATE if self.host_step else Terms.OPTIMIZER_STATE
        for flat in self.flats:
            shape = flat.shape
            grad = flat.landing if flat.landing is not None else replay.reduced_buffer(flat)
            with label(step_label):
                if grad.dtype != shape.role.master_dtype:
                    grad = grad.to(shape.role.master_dtype)
            if shape.offload_optimizer and flat.landing is None:  # HostGradients.receive
                with label(Terms.HOST_GRADS):
                    flat.landing = torch.empty(grad.numel(), dtype=grad.dtype, device=grad.device)
                grad = flat.landing
            flat.master.grad = grad
            grads.append(grad)
        with label(step_label):
            for flat, grad in zip(self.flats, grads, strict=True):  # global_norm's partials
                shard = grad if flat.shape.policy.shard_optimizer else flat.shard_of(grad)
                shard.float().pow(2).sum()
            if self.optimizer is not None:
                self.optimizer.step()
        self._publish()
        for flat in self.flats:
            flat.master.grad = None
            self._clear_reduced(flat)

    def _publish(self) -> None:
        """step/publish.py: stages 1-2 all-gather the updated masters (all_gather_shards' buckets
        of `allgather_bucket_size` elements, two in flight), one gather per parameter dtype."""
        groups: dict[torch.dtype, list[ReplayFlat]] = {}
        for flat in self.flats:
            if flat.shape.policy.shard_optimizer and not flat.shape.params_sharded:
                groups.setdefault(flat.shape.role.param_dtype, []).append(flat)
        for wire, pieces in groups.items():
            size = pieces[0].shape.shard_size
            capacity = max(1, self.config.zero_optimization.allgather_bucket_size // size)
            in_flight: list[list[torch.Tensor]] = []
            slots: list[tuple[ReplayFlat, int]] = []
            columns = 0
            with self.replay.ledger.label(Terms.PUBLISH):
                for flat in pieces:
                    n, c0 = flat.shape.shard_numel, 0
                    while c0 < n:
                        take = min(capacity - columns, n - c0)
                        slots.append((flat, take))
                        columns, c0 = columns + take, c0 + take
                        if columns == capacity:
                            self._issue(in_flight, slots, columns, size, wire)
                            slots, columns = [], 0
                if slots:
                    self._issue(in_flight, slots, columns, size, wire)
            in_flight.clear()

    def _issue(self, in_flight: list, slots: list, columns: int, size: int, wire: torch.dtype) -> None:
        while len(in_flight) >= MAX_IN_FLIGHT:
            in_flight.pop(0)
        device = self.replay.device
        if len(slots) == 1 and columns == slots[0][0].shape.shard_numel:
            # One whole piece: its source copied, gathered straight into the target.
            in_flight.append([torch.empty(columns, dtype=wire, device=device)])
        else:
            in_flight.append([torch.empty(columns, dtype=wire, device=device),
                              torch.empty(size, columns, dtype=wire, device=device)])

    def _clear_reduced(self, flat: ReplayFlat) -> None:
        """grads/buffers.py `clear_reduced`: kept (and the in-place local adopted back) on the CPU,
        freed on an accelerator."""
        if not self.replay.keep_grads:
            flat.reduced = flat.reduced_full = None
            if not flat.shape.policy.reduce_every_backward:
                flat.local = None
            return
        if not flat.shape.policy.reduce_every_backward and flat.reduced_full is not None:
            flat.local, flat.reduced, flat.reduced_full = flat.reduced_full, None, None
