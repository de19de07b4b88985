"""The stage-3 internals TRL reads to generate with gathered weights (DeepSpeed's names).

TRL 1.16's `unwrap_model_for_generation` (trl/models/utils.py), used by GRPO, online DPO, GKD
and the completion callbacks, does under ZeRO-3:

    with deepspeed.zero.GatheredParameters(engine.parameters()):
        remove_hooks(engine)     # engine.optimizer.parameter_offload: .module, .forward_hooks,
        yield unwrapped_model    #   .backward_hooks (each .remove()), param.ds_active_sub_modules,
        add_hooks(engine)        #   module.ds_external_parameters(); then .param_coordinator and
                                 #   ._register_deepspeed_module(module) to put them back

Removing the hooks matters: with every parameter gathered, generation must run without the
per-unit gathers and frees, which are collectives (ranks generating different numbers of tokens
would hang in them) and would free what the context gathered after the first forward. Here
`forward_hooks` holds one handle whose `remove()` detaches stage 3's parameter schedule
(zeroshard/sharding/schedule.py) from the gradient path, so forwards use the parameters as they
are, as at stages 0-2; `_register_deepspeed_module` attaches a new schedule built as `initialize`
built it (it learns the units' order again on the next forward; `param_coordinator`'s
`_invalidate_trace` is that reset). `backward_hooks` is empty: zeroshard's backward-side work
hangs off the forward's outputs and the parameters' own hooks, which stay.

Attached to the engine's optimizer as `parameter_offload` at stage 3 only (DeepSpeed's stage-3
optimizer has it; TRL checks `hasattr`).
"""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["ParameterOffload", "attach_parameter_offload"]


class _ScheduleHandle:
    """A hook handle as TRL removes it: detaches the schedule from the gradient path."""

    def __init__(self, offload: ParameterOffload) -> None:
        self._offload = offload

    def remove(self) -> None:
        self._offload._detach()


class _Coordinator:
    """DeepSpeed's parameter coordinator, as far as TRL's `add_hooks` asks it."""

    def __init__(self, offload: ParameterOffload) -> None:
        self._offload = offload

    def is_invalid_trace(self) -> bool:
        schedule = self._offload._grads.params
        return schedule is None or not schedule._forward_order

    def _invalidate_trace(self) -> None:
        schedule = self._offload._grads.params
        if schedule is not None:
            schedule._forward_order, schedule._position = [], {}


class ParameterOffload:
    """`engine.optimizer.parameter_offload` at stage 3 (module docstring)."""

    def __init__(self, engine: Any) -> None:
        self.module: nn.Module = engine.module
        self._grads = engine._grads  # the gradient path; `.params` is the stage-3 schedule
        self._rebuild = _rebuilder(self._grads.params)
        self.forward_hooks: list[Any] = [_ScheduleHandle(self)]
        self.backward_hooks: list[Any] = []
        self.param_coordinator = _Coordinator(self)

    @property
    def hooks_attached(self) -> bool:
        return self._grads.params is not None

    def _detach(self) -> None:
        schedule = self._grads.params
        if schedule is not None:
            schedule.remove()
            self._grads.params = None

    def _register_deepspeed_module(self, module: nn.Module) -> None:
        if module is not self.module:
            raise ValueError("parameter_offload._register_deepspeed_module: zeroshard re-arms only the engine's "
                             "own module (engine.module).")
        if self._grads.params is None:
            self._grads.params = self._rebuild()
        self.forward_hooks = [_ScheduleHandle(self)]


def _rebuilder(schedule: Any):
    units, prefetch, in_backward, inputs_reached = (
        schedule.units, schedule.prefetch_numel, schedule._in_backward, schedule._inputs_reached,
    )

    def rebuild() -> Any:
        return type(schedule)(units, prefetch, in_backward, inputs_reached)

    return rebuild


def _no_external_parameters() -> list[tuple[str, nn.Parameter]]:
    # DeepSpeed's register_external_parameter has no counterpart: a unit's parameters used by
    # another module are gathered on use (zeroshard/sharding/direct_use.py).
    return []


def attach_parameter_offload(engine: Any) -> None:
    """Give a stage-3 engine the names TRL reads (module docstring); nothing below stage 3."""
    if engine._grads.params is None or engine.optimizer is None:
        return
    engine.optimizer.parameter_offload = ParameterOffload(engine)
    engine.module.ds_external_parameters = _no_external_parameters
    for p in engine.module.parameters():
        if not hasattr(p, "ds_active_sub_modules"):
            p.ds_active_sub_modules = set()
