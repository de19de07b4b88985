"""The engine's memory guard: the budget check before the first step and the out-of-memory
report during training (budget.py, oom.py).

[Note: checking the budget with the real model]
At `initialize` the sequence length is unknown, so the first check predicts what does not depend
on it: the model states, buffers and the optimizer step (a trace without a forward). At the first
training forward the inputs are there: the prediction traces one whole step of a copy of the
model whose parameters and buffers are fake tensors (no memory; `copy.deepcopy` with them in its
memo, so the engine's hooks come along inert), fed fake copies of the inputs. Every rank predicts
its own peak, the ranks agree on the largest (one all-reduce, so either all refuse or none does),
and a peak above the budget is refused before the real forward allocates anything.
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from zeroshard.comm import collectives as comm
from zeroshard.comm import faults
from zeroshard.config.schema import ZeroshardConfig
from zeroshard.memory.budget import budget_bytes, refusal
from zeroshard.memory.oom import out_of_memory_report, start_recording
from zeroshard.memory.plan import MemoryPlan, predict_memory
from zeroshard.memory.trace import ModelSpec

__all__ = ["MemoryGuard"]

logger = logging.getLogger("zeroshard")


def fake_structure(model: nn.Module) -> nn.Module:
    """A copy of `model` whose parameters and buffers are new fake tensors of the same full shape
    and dtype (call under FakeTensorMode; stage 3's freed parameters keep their full `ds_shape`)."""
    memo: dict[int, Any] = {}
    for p in model.parameters():
        shape = getattr(p, "ds_shape", None) if p.numel() == 0 else None
        full = p.shape if shape is None else shape
        memo[id(p)] = nn.Parameter(torch.empty(full, dtype=p.dtype), requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = torch.empty(b.shape, dtype=b.dtype)
    return copy.deepcopy(model, memo)


def _fake_like(tree: Any) -> Any:
    return torch.utils._pytree.tree_map(
        lambda t: torch.empty_like(t, device="cpu") if isinstance(t, torch.Tensor) else t, tree)


class MemoryGuard:
    """The budget check and the out-of-memory report for one engine (the note above)."""

    def __init__(self, config: ZeroshardConfig, group: comm.Group, device: torch.device, traced: bool = True,
                 untraced_reason: str = "expert-parallel model") -> None:
        self.config = config
        self.group = group
        self.world_size = group.size
        self.rank = group.rank
        self.device = device
        # `traced`: the prediction knows this model's flats (not yet expert-parallel ones: they
        # shard over their own groups; nor tensor-parallel ones: their pieces shard over the data
        # group, not the world, and the split layers' exchanges do not trace), so the budget can
        # be checked.
        self.budget, self.source = budget_bytes(config, device) if traced else (None, untraced_reason)
        extras = config.zeroshard
        if not traced and "memory_budget_gb" in extras.model_fields_set and extras.memory_budget_gb is not None:
            if group.rank == 0:  # the budget the config asks for is not checked: say so once
                logger.warning("zeroshard: zeroshard.memory_budget_gb=%g: not checked for a %s (its flats are not "
                               "laid out by the prediction yet).", extras.memory_budget_gb, untraced_reason)
        self.prediction: MemoryPlan | None = None
        self._pending_forward = self.budget is not None
        self.recording = start_recording(device) if self.budget is not None else False
        self._handles: list[Any] = []

    @property
    def on(self) -> bool:
        return self.budget is not None

    # ------------------------------------------------------------------ the budget
    def check_states(self, model: nn.Module) -> None:
        """At initialize, before any flat exists: the states, buffers and step (no forward yet)."""
        if not self.on:
            return
        spec = ModelSpec("the model", lambda: fake_structure(model))
        self._check(spec, None, None, " before the first forward (states, buffers, optimizer step)")

    def check_first_forward(self, model: nn.Module, args: tuple, kwargs: dict) -> None:
        """At the first training forward: one whole step at the real inputs' shapes."""
        if not self._pending_forward or not (model.training and torch.is_grad_enabled()):
            return
        self._pending_forward = False
        spec = ModelSpec("the model", lambda: fake_structure(model),
                         lambda m, b, t: (_fake_like(args), _fake_like(kwargs)))
        first = next((t for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)), None)
        shape = list(first.shape) if first is not None else []
        self._check(spec, shape[0] if shape else 1, shape[1] if len(shape) > 1 else None, "")

    def _check(self, spec: ModelSpec, micro_batch: int | None, seq: int | None, what: str) -> None:
        try:
            plan = predict_memory(spec, self.config, self.world_size, micro_batch=micro_batch, seq=seq,
                                  device_type=self.device.type)
        except Exception as exc:  # noqa: BLE001 - a model the trace cannot copy is not refused for it
            logger.warning("zeroshard: the memory check could not trace this model (%s: %s); it is skipped.",
                           type(exc).__name__, exc)
            return
        self.prediction = plan
        peaks = comm.all_gather_object([plan.device_peak_bytes, plan.peak_phase, plan.parts], group=self.group)
        worst = max(range(len(peaks)), key=lambda r: peaks[r][0])
        peak, phase, parts = peaks[worst]
        if peak > self.budget:
            raise refusal(self.config, peak, worst, phase, parts, self.budget, self.source, what)

    # ------------------------------------------------------------------ out of memory
    def attach_unit_names(self, units: list[Any]) -> None:
        """Name the running unit in a forward's report (stage 3 names it when gathering); the
        phase puts the previous name back when the forward ends (oom.py), so a collective after it
        is not named after the last unit."""
        for unit in units[1:]:
            name = unit.name
            self._handles.append(unit.module.register_forward_pre_hook(
                lambda module, args, name=name: setattr(faults.where, "unit", name)))
            self._handles.append(unit.module.register_forward_hook(
                lambda module, args, output: setattr(faults.where, "unit", None)))  # not on an error: it is reported

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        def predicted() -> dict | None:
            return self.prediction.as_dict() if self.prediction is not None else None

        with out_of_memory_report(name, self.rank, self.device, predicted, self.recording):
            yield

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
