"""The DeepSpeed engine methods that the Hugging Face Trainer and Accelerate call.

`HFCompat` is mixed into `Engine`. transformers 5.23 and accelerate 1.15 call, on the engine
`deepspeed.initialize` returned:

- `_zero3_consolidated_16bit_state_dict()` (accelerate's `get_state_dict`, the Trainer's
  `save_model` at stage 3) and `_consolidated_16bit_state_dict()`: the full weights on rank 0;
- `save_checkpoint`/`load_checkpoint` (engine.py), `zero_gather_16bit_weights_on_model_save`
  (api.py) and `compile(backend=..., compile_kwargs=...)` (compile.py; Accelerate calls it when
  `torch_compile` is set).

The consolidation itself is zeroshard/checkpoint/export.py's, shared with `save_16bit_model`.
"""

from __future__ import annotations

from collections import OrderedDict


class HFCompat:
    """DeepSpeed's export entry points; expects the attributes `Engine` sets."""

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
