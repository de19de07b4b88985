"""The DeepSpeed engine methods that the Hugging Face Trainer and Accelerate call.

`HFCompat` is mixed into `Engine`. transformers 5.23 and accelerate 1.15 call, on the engine
`deepspeed.initialize` returned:

- `_zero3_consolidated_16bit_state_dict()` (accelerate's `get_state_dict`, the Trainer's
  `save_model` at stage 3) and `_consolidated_16bit_state_dict()`: the full weights on rank 0;
- `compile(backend=..., compile_kwargs=...)` (accelerate, when `torch_compile` is set);
- `save_checkpoint`/`load_checkpoint` (engine.py) and `zero_gather_16bit_weights_on_model_save`
  (api.py).

The consolidation itself is zeroshard/checkpoint/export.py's, shared with `save_16bit_model`.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any

logger = logging.getLogger("zeroshard")


class HFCompat:
    """DeepSpeed's export and compile entry points; expects the attributes `Engine` sets."""

    _compile_requested: dict[str, Any] | None = None

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False):
        """The full, unsharded state dict in the parameter dtype (bf16 under bf16, fp32 under
        fp32), on the host: an OrderedDict on rank 0, None on the others, as DeepSpeed returns.
        Collective: every rank must call it. Stage 3 only, as DeepSpeed's (ValueError otherwise).
        """
        if self.zero_optimization_stage() != 3:
            raise ValueError(
                "_zero3_consolidated_16bit_state_dict: this function requires ZeRO-3 mode "
                f"(zero_optimization.stage is {self.zero_optimization_stage()}). At stages 0-2 every rank holds "
                "the whole model: read engine.module.state_dict()."
            )
        return self._gather_16bit_state_dict(exclude_frozen_parameters)

    def _consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False):
        """The whole weights where they are split: at stage 3, or with tensor parallelism at any
        stage (pieces gathered over the tensor group: Accelerate's `get_state_dict` and the
        Trainer's `save_model` call this for AutoTP); DeepSpeed's ValueError otherwise."""
        if self.zero_optimization_stage() != 3 and self.layout.tensor is None:
            raise ValueError(
                "consolidated_16bit_state_dict is only applicable where weights are partitioned (ZeRO stage 3); "
                f"zero_optimization.stage is {self.zero_optimization_stage()}: read engine.module.state_dict()."
            )
        return self._gather_16bit_state_dict(exclude_frozen_parameters)

    def _gather_16bit_state_dict(self, exclude_frozen_parameters: bool):
        from zeroshard.checkpoint.export import consolidated_16bit_state_dict

        state = consolidated_16bit_state_dict(self, exclude_frozen_parameters)
        return None if state is None else OrderedDict(state)

    def compile(
        self,
        backend: Any = "inductor",
        compile_kwargs: dict[str, Any] | None = None,
        schedule: Any = None,
        compiled_autograd_enabled: bool = False,
    ) -> None:
        """Accepted with DeepSpeed's signature; the module keeps running eagerly.

        zeroshard's stage-3 gathers, gradient hooks and end-of-backward callback run in module
        hooks and custom autograd functions that torch.compile would break the graph at, so
        compiling the whole engine gains little and is not tested. Compile your own blocks
        (`torch.compile(block)` on the model before `initialize`) to get compiled compute.
        Warns once; `is_compiled` stays False so callers that check it see the truth.
        """
        if schedule is not None:
            raise ValueError(
                "engine.compile(schedule=...): DeepCompile schedules are not supported by zeroshard. "
                "Call compile() without schedule."
            )
        if self._compile_requested is None:
            logger.warning(
                "engine.compile(backend=%r): zeroshard runs the module eagerly (DeepSpeed would compile it). "
                "Compile the model's blocks with torch.compile before initialize for compiled compute.",
                backend,
            )
        self._compile_requested = {"backend": backend, **(compile_kwargs or {})}

    @property
    def is_compiled(self) -> bool:
        """False: `compile()` leaves the module eager (see there)."""
        return False
