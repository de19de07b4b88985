"""The DeepSpeed engine methods that only report or adjust the engine's state.

`EngineAPI` is mixed into `Engine` (engine.py orchestrates; these are the small accessors and
controls a DeepSpeed script calls): the config queries, DeepSpeed's step counters (kept by the
engine's `Accumulation`, zeroshard/grads/accumulation.py), `scale`, `was_step_applied`,
`destroy`, `empty_partition_cache` and `coalesce_grad_reduction`; the accessors trainers read
(`torch_autocast_enabled`, `torch_autocast_dtype`, `has_moe_layers`, `modules`), and DeepSpeed's
fallback of attribute reads to the wrapped module.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from zeroshard.config.base import canonical_dtype_name
from zeroshard.config.sections import DEFAULT_LOWER_PRECISION_SAFE_MODULES
from zeroshard.moe.autoep.layer import AutoEPMoELayer
from zeroshard.moe.layer import MoE

if TYPE_CHECKING:
    from zeroshard.config.schema import ZeroshardConfig
    from zeroshard.grads.accumulation import Accumulation


_TORCH_DTYPE = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


class _PreScaledLoss(torch.autograd.Function):
    """`loss * scale` whose backward tells the engine that this backward is already scaled.

    The engine applies the loss scale where the gradient enters the model (zeroshard/grads/path.py), so a
    plain `loss.backward()` is scaled; a loss that went through `engine.scale` must not be
    scaled there again. Its backward runs first in the graph task (the loss is the root), marks
    the engine's accumulation state as prescaled and queues a callback that clears it when the graph task ends, so the
    flag never outlives this one backward, whether or not the loss reached the model.
    """

    @staticmethod
    def forward(ctx, loss: torch.Tensor, scale: float, engine: Any) -> torch.Tensor:
        ctx.scale = scale
        ctx.engine = engine
        return loss * scale

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        state = ctx.engine.accumulation
        state.set_prescaled(True)

        def clear() -> None:
            state.set_prescaled(False)

        torch.autograd.Variable._execution_engine.queue_callback(clear)
        return grad * ctx.scale, None, None


class EngineAPI:
    """DeepSpeed's query and control methods; expects the attributes `Engine` sets."""

    config: ZeroshardConfig
    accumulation: Accumulation

    def __getattr__(self, name: str) -> Any:
        # Python calls this only when normal lookup failed, so the engine's own attributes
        # always win (DeepSpeed's engine falls back to its module the same way: `engine.moe_1`).
        # The module is read from __dict__ so an engine without one (unpickling, a failed
        # __init__) raises instead of recursing; dunder names are never forwarded, so copy and
        # pickle probes see the engine's own protocol, not the module's.
        module = self.__dict__.get("module")
        if module is not None and not (name.startswith("__") and name.endswith("__")):
            try:
                return getattr(module, name)
            except AttributeError:
                pass
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")

    def modules(self) -> Iterator[torch.nn.Module]:
        """The wrapped module's `modules()`. DeepSpeed's engine is itself an nn.Module and yields
        itself first; this engine is not one, and, like `parameters()`, answers for the module."""
        return self.module.modules()

    def named_modules(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, torch.nn.Module]]:
        """The wrapped module's `named_modules()` (names without DeepSpeed's "module." prefix)."""
        return self.module.named_modules(*args, **kwargs)

    @property
    def has_moe_layers(self) -> bool:
        """Whether the module holds an MoE layer (zeroshard's `MoE` or an AutoEP layer), as
        DeepSpeed's attribute that trainers read to choose MoE-aware checkpointing."""
        return any(isinstance(m, (MoE, AutoEPMoELayer)) for m in self.module.modules())

    def torch_autocast_enabled(self) -> bool:
        return self.config.torch_autocast.enabled

    def torch_autocast_dtype(self) -> torch.dtype:
        """The `torch_autocast.dtype` as a torch dtype (bfloat16 unless the config names one)."""
        return _TORCH_DTYPE[canonical_dtype_name(self.config.torch_autocast.dtype)]

    def torch_autocast_lower_precision_safe_modules(self) -> list[str]:
        """The configured dotted class names, or the default ones (torch's Linear and Conv1d-3d,
        DeepSpeed's default classes, spelled by their public paths)."""
        names = self.config.torch_autocast.lower_precision_safe_modules
        return list(DEFAULT_LOWER_PRECISION_SAFE_MODULES if names is None else names)

    # ----------------------------------------------------------------- config
    def fp16_enabled(self) -> bool:
        return self.config.fp16.enabled

    def bfloat16_enabled(self) -> bool:
        """`bf16.enabled` (or its legacy section `bfloat16`)."""
        return self.config.bf16.enabled

    def zero_optimization_stage(self) -> int:
        return self.config.zero_optimization.stage

    def gradient_clipping(self) -> float:
        return self.config.gradient_clipping

    def managed_gradient_accumulation(self) -> bool:
        """False: `step()` alone is the accumulation boundary (DeepSpeed 0.19's unmanaged mode)."""
        return self.config.managed_gradient_accumulation

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        """`stage3_gather_16bit_weights_on_model_save` (or its legacy fp16 spelling): accelerate
        asks it before consolidating a stage-3 model for `save_model`."""
        zero = self.config.zero_optimization
        return zero.stage3_gather_16bit_weights_on_model_save or zero.stage3_gather_fp16_weights_on_model_save

    # --------------------------------------------------------------- counters
    # DeepSpeed's attributes; a checkpoint load sets them.
    @property
    def micro_steps(self) -> int:
        """step() calls that counted (a repeated call without a backward does not)."""
        return self.accumulation.micro_steps

    @micro_steps.setter
    def micro_steps(self, value: int) -> None:
        self.accumulation.micro_steps = value

    @property
    def global_steps(self) -> int:
        """Boundary steps, skipped ones included."""
        return self.accumulation.global_steps

    @global_steps.setter
    def global_steps(self, value: int) -> None:
        self.accumulation.global_steps = value

    @property
    def skipped_steps(self) -> int:
        return self.accumulation.skipped_steps

    @skipped_steps.setter
    def skipped_steps(self, value: int) -> None:
        self.accumulation.skipped_steps = value

    @property
    def global_samples(self) -> int:
        """A train batch per step, or with unmanaged accumulation a micro-batch on every rank
        per backward."""
        return self.accumulation.global_samples

    @global_samples.setter
    def global_samples(self, value: int) -> None:
        self.accumulation.global_samples = value

    # ------------------------------------------------------------------ state
    def was_step_applied(self) -> bool:
        """Whether the last `step()` changed the parameters: False between accumulation
        boundaries and when a non-finite gradient skipped the update."""
        return self.accumulation.step_applied

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss times the current loss scale, for `engine.scale(loss).backward()`.

        fp16 with loss scaling: the engine does not scale that backward a second time, so the
        gradients equal those of `engine.backward(loss)` or a plain `loss.backward()`. Without
        loss scaling (scale 1): `loss` itself.
        """
        if self.optimizer is None:
            raise RuntimeError("engine.scale(): no optimizer. Set 'optimizer' in the config or pass optimizer=.")
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or loss.grad_fn is None:
            raise ValueError(
                "engine.scale(loss): loss must be a scalar tensor with a grad_fn. For a non-scalar "
                "output, call output.backward(grad) (the engine scales it)."
            )
        scale = self.loss_scaler.scale
        if scale == 1.0:
            return loss
        return _PreScaledLoss.apply(loss, scale, self)

    def empty_partition_cache(self) -> None:
        """Free every gathered stage-3 parameter (they are gathered again when next used) and
        return cached accelerator memory. A no-op for parameters kept whole (stages 0-2 and
        stage-3 units under `stage3_param_persistence_threshold`)."""
        if self.accumulation.in_backward or self._grads.forward_depth:
            raise RuntimeError("engine.empty_partition_cache(): call it outside forward and backward.")
        if self._grads.params is not None:
            self._grads.params.free_all()  # pins too
        for unit in self.units:
            unit.free()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def destroy(self) -> None:
        """Remove the engine's hooks from the module (DeepSpeed's cleanup). The engine cannot
        train afterwards; the module's parameters stay where the stage keeps them (at stage 3,
        shards: gather them first with `GatheredParameters` if the module is to be used alone).
        The monitors' files are flushed and closed, and an asynchronous save is waited for."""
        from zeroshard.checkpoint import wait_for_checkpoint

        wait_for_checkpoint("destroy()")
        self.monitor.close()
        self._grads.remove()
        if self._grads.params is not None:  # stage 3's gather and free hooks
            self._grads.params.remove()
        for unit in self.units:
            unit.free()
        self.figures.close()  # its router hooks and collective logs (zeroshard/monitor/figures.py)

    @contextlib.contextmanager
    def coalesce_grad_reduction(self) -> Iterator[None]:
        """One with-block is one optimizer step: every backward inside keeps its gradients
        local (no communication), the exit reduces their sum once, and the `step()` after the
        block is the accumulation boundary. ZeRO stages 1-3, as DeepSpeed; `step()` inside the
        block is an error, and so is nesting it in `no_sync()`."""
        if not self.config.managed_gradient_accumulation:
            raise RuntimeError(
                "coalesce_grad_reduction(): with managed_gradient_accumulation false, step() already "
                "decides the boundary; call backward several times, then step()."
            )
        if self.config.zeroshard.deterministic_reduction:
            from zeroshard.engine.deterministic import refusal

            raise refusal("engine.coalesce_grad_reduction()", "Call engine.backward and engine.step() per micro-batch.")
        if self.config.zero_optimization.stage == 0:
            raise NotImplementedError("coalesce_grad_reduction() needs ZeRO stage 1, 2 or 3 (as in DeepSpeed).")
        with self.accumulation.coalescing():
            yield
        self._grads.flush()  # one reduction pass, the same collectives on every rank
        self.accumulation.coalesced()
