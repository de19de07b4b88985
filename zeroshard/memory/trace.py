"""One training step of a model, traced on fake tensors with the engine's buffers around it.

`trace_step` builds the model under `FakeTensorMode` (no memory), casts it as the engine does,
lays out its units and flats (layout.py), allocates the model states (replay.py), runs one
warm-up step (the optimizer creates its state, the CPU's gradient buffers come to exist), then
the measured one: forward, backward, optimizer step, with every allocation in the ledger
(ledger.py's note). Also traced, without the engine: the model's activations with and
without activation checkpointing, for the report's parts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.checkpoint import checkpoint

from zeroshard.config.schema import ZeroshardConfig
from zeroshard.grads.reduce import default_bucket_numel
from zeroshard.memory.layout import UnitShape, model_layout
from zeroshard.memory.ledger import ACTIVATIONS, Ledger, Peak
from zeroshard.memory.replay import EngineReplay, Terms
from zeroshard.memory.replay_step import StepReplay
from zeroshard.memory.workspaces import workspace_rule
from zeroshard.precision.autocast import forward_context
from zeroshard.precision.plan import PrecisionPlan, assign_param_groups

__all__ = ["ModelSpec", "StepTrace", "trace_step"]

INPUTS = "inputs"
_AC_KEYS = {False: "without_checkpointing", True: "with_checkpointing"}


def default_loss(output: Any) -> torch.Tensor:
    """The loss in a model's output: a 0-d tensor, `.loss`, or a tuple's 0-d floating element;
    otherwise the sum of the first floating output (a stand-in that costs what a loss costs)."""
    if isinstance(output, torch.Tensor):
        return output if output.dim() == 0 else output.float().sum()
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    leaves = torch.utils._pytree.tree_leaves(output)
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor) and leaf.dim() == 0 and leaf.is_floating_point() and leaf.requires_grad:
            return leaf
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point() and leaf.requires_grad:
            return leaf.float().sum()
    raise ValueError("the model's output holds no floating tensor that requires grad: nothing to backward")


@dataclass
class ModelSpec:
    """How to build a model and feed it, for the trace.

    Attributes:
        name: what the report calls it.
        build: returns the model; called under FakeTensorMode.
        inputs: (model, micro_batch, seq) -> (args, kwargs) of one micro-batch; called under
            FakeTensorMode. None: the model's inputs are unknown (no activations traced).
        max_seq: the longest sequence the model takes (the default of `--seq`).
        loss: the loss from the model's output.
    """

    name: str
    build: Callable[[], nn.Module]
    inputs: Callable[[nn.Module, int, int], tuple[tuple, dict]] | None = None
    max_seq: int | None = None
    loss: Callable[[Any], torch.Tensor] = default_loss


@dataclass
class StepTrace:
    """What one traced step held, per rank (bytes)."""

    device: Peak
    host: Peak
    combined: Peak
    phase_peaks: dict[str, int]
    activations: dict[str, int] = field(default_factory=dict)
    units: list[UnitShape] = field(default_factory=list)
    num_params: int = 0
    traced: bool = True  # False: the model's inputs are unknown, no forward was traced


# torch.utils.checkpoint keeps the CPU generator's state (torch.get_rng_state(), made outside
# the dispatcher, so the trace cannot see it) from a unit's forward to its recomputation.
_CPU_RNG_STATE_BYTES = torch.get_rng_state().numel()


class _Checkpointed(nn.Module):
    """A unit run under non-reentrant activation checkpointing, as `checkpoint(block, x)`.
    `rng_state`: count the CPU generator state it keeps (host memory: on the CPU it is the
    device's)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.enabled = True
        self.rng_state = False
        self._kept: list[torch.Tensor] = []
        inner.register_forward_pre_hook(self._recomputing)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.enabled and torch.is_grad_enabled():
            if self.rng_state:
                self._kept.append(torch.empty(_CPU_RNG_STATE_BYTES, dtype=torch.uint8))
            return checkpoint(self.inner, *args, use_reentrant=False, **kwargs)
        return self.inner(*args, **kwargs)

    def _recomputing(self, module: nn.Module, args: Any) -> None:
        if self._kept and torch._C._current_graph_task_id() != -1:  # the recomputation, in backward
            self._kept.pop(0)


def _wrap_units(model: nn.Module, units: list[UnitShape]) -> list[_Checkpointed]:
    unit_modules = {id(u.module) for u in units[1:]}
    wrappers = []
    for parent in list(model.modules()):
        for name, child in list(parent._modules.items()):
            if child is not None and id(child) in unit_modules:
                wrapper = _Checkpointed(child)
                parent._modules[name] = wrapper
                wrappers.append(wrapper)
    return wrappers


def cast_like_engine(model: nn.Module, plan: PrecisionPlan) -> None:
    """engine/setup.py's cast_module: every parameter in its precision group's dtype."""
    names = assign_param_groups(plan, model)
    with torch.no_grad():
        for n, p in model.named_parameters():
            dtype = plan.groups[names[n]].param_dtype
            if p.dtype != dtype and p.is_floating_point():
                p.data = p.data.to(dtype)
        if plan.buffer_dtype is not None:
            for owner in model.modules():
                for leaf, buf in list(owner._buffers.items()):
                    if buf is not None and buf.is_floating_point():
                        owner._buffers[leaf] = buf.to(plan.buffer_dtype)


def _drop_grads(model: nn.Module) -> list[Any]:
    """The engine's hooks take every gradient and drop `.grad` (grads/path.py)."""
    return [p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
            for p in model.parameters() if p.requires_grad]


def _saved_after_forward(model: nn.Module, spec: ModelSpec, inputs: tuple, plan: PrecisionPlan,
                         device_type: str) -> int:
    """The model alone: bytes its forward leaves saved for backward (and its output)."""
    args, kwargs = inputs
    ledger = Ledger(ignore=[*model.parameters(), *model.buffers(), *_tensors(inputs)],
                    workspace=workspace_rule(device_type))
    with ledger:
        with forward_context(plan, "cpu"):  # the fake tensors are CPU tensors
            loss = spec.loss(model(*args, **kwargs))
        saved = ledger.now["all"]
        del loss
    return saved


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in torch.utils._pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


def trace_step(
    spec: ModelSpec,
    config: ZeroshardConfig,
    world_size: int,
    *,
    micro_batch: int | None = None,
    seq: int | None = None,
    activation_checkpointing: bool = False,
    device_type: str = "cuda",
    rank: int = 0,
    both_checkpointing: bool = True,
) -> StepTrace:
    """Trace one steady-state training step of `spec` under `config` as rank `rank` of
    `world_size` (see the module docstring). `device_type` "cpu" follows the engine's CPU
    choices (gradient buffers kept, gloo's bucket default, torch's per-tensor AdamW), anything
    else an accelerator's (buffers freed after the step, the largest flat as bucket, fused AdamW).
    `both_checkpointing`: also trace a forward under the other activation-checkpointing setting,
    for the report's `activations` (the peak does not need it)."""
    plan = config.precision_plan
    policy = config.stage_policy
    micro_batch = micro_batch or config.train_micro_batch_size_per_gpu or 1
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    with fake:
        model = spec.build()
        cast_like_engine(model, plan)
        model.train()
        inputs = None
        if spec.inputs is not None:
            inputs = spec.inputs(model, micro_batch, seq or spec.max_seq or 1)
    units = model_layout(model, config, plan, policy, world_size, rank)
    num_params = sum(p.numel() for p in model.parameters())
    wrappers = _wrap_units(model, units)
    activations: dict[str, int] = {}
    if inputs is not None and both_checkpointing:  # the other setting than the measured pass's: a forward
        for w in wrappers:
            w.enabled = not activation_checkpointing
        with fake:
            activations[_AC_KEYS[not activation_checkpointing]] = _saved_after_forward(
                model, spec, inputs, plan, device_type)
    for w in wrappers:
        w.enabled = activation_checkpointing
        w.rng_state = device_type == "cpu"

    trainable = [p for p in model.parameters() if p.requires_grad]
    ledger = Ledger(ignore=trainable, workspace=workspace_rule(device_type))
    zero = config.zero_optimization
    bucket = zero.reduce_bucket_size
    if "reduce_bucket_size" not in zero.model_fields_set:
        bucket = default_bucket_numel("gloo" if device_type == "cpu" else "nccl", [f for u in units for f in u.flats])
    replay = EngineReplay(ledger, units, device_type, bucket, zero.stage3_prefetch_bucket_size)
    with fake, ledger:
        with ledger.label(Terms.BUFFERS):
            for p in model.parameters():
                if not p.requires_grad:
                    ledger.add(p)
            for buf in model.buffers():
                ledger.add(buf)
        if inputs is not None:
            for leaf in torch.utils._pytree.tree_leaves(inputs):
                if isinstance(leaf, torch.Tensor):
                    ledger.add(leaf, INPUTS)
        replay.allocate_states()
        replay.allocate_steady_gradients()
        step = StepReplay(replay, config, plan, device_type)
        step.run(warmup=True)
        ledger.reset_peak()
        if inputs is not None:
            replay.attach(model)
            try:
                activations[_AC_KEYS[activation_checkpointing]] = _measured_pass(
                    ledger, replay, model, spec, inputs, plan, device_type)
            finally:
                replay.detach()
        ledger.enter_phase("step")
        step.run()
    return StepTrace(
        device=ledger.peaks["device"], host=ledger.peaks["host"], combined=ledger.peaks["all"],
        phase_peaks=dict(ledger.phase_peaks), activations=activations, units=units, num_params=num_params,
        traced=inputs is not None,
    )


def _measured_pass(ledger: Ledger, replay: EngineReplay, model: nn.Module, spec: ModelSpec, inputs: tuple,
                   plan: PrecisionPlan, device_type: str) -> int:
    """Forward and backward with the engine's buffers; returns the activations the forward saved."""
    args, kwargs = inputs
    ledger.enter_phase("forward")
    with forward_context(plan, "cpu"):  # the fake tensors are CPU tensors
        # Only the loss is kept: the other outputs (logits) die before the backward, as in a loop
        # that takes `outputs.loss` (a loop that keeps them holds them through the step).
        loss = spec.loss(model(*args, **kwargs))
    saved = ledger.by_label[ACTIVATIONS]
    loss.register_hook(lambda grad: replay.start_backward())
    ledger.enter_phase("backward")
    loss.backward()
    del loss
    return saved
