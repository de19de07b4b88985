"""The fp8 Linear layer: torchao's float8 training, fed at stage 3 by an fp8 gather.

Imported only when `zeroshard.fp8` is enabled (torchao is the optional extra
`zeroshard[fp8]`). `swap_to_fp8` replaces the Linears that `fp8_linear_plan` chose (zeroshard/
precision/fp8.py's [Note: fp8 compute]) with `Fp8Linear`, which keeps the same Parameter
objects. Its forward is torchao's `Float8Linear.forward` (the weight cast to fp8 with a dynamic
scale at every use), except when the engine has gathered the weight in fp8 already (stage 3,
zeroshard/sharding/fp8_gather.py): then the gathered bytes and their scale are the fp8 weight,
and the gradient still reaches the module's Parameter.
"""

from __future__ import annotations

import dataclasses
import logging

import torch
from torch import nn

from zeroshard.precision.fp8 import Fp8Settings, fp8_linear_plan

# torchao's import logs a warning for each compiled extension it cannot load here (its CUDA
# kernels on a CPU machine); float8 training's matmuls do not use them. Quiet during the import only.
_torchao_log = logging.getLogger("torchao")
_level = _torchao_log.level
_torchao_log.setLevel(logging.ERROR)
try:
    from torchao.float8 import Float8LinearConfig
    from torchao.float8.float8_linear import Float8Linear, matmul_with_hp_or_float8_args
    from torchao.float8.float8_training_tensor import Float8TrainingTensor, GemmInputRole
    from torchao.float8.float8_utils import amax_to_scale, to_fp8_saturated
except ImportError as exc:  # pragma: no cover - exercised where torchao is missing
    raise ImportError(
        f"zeroshard.fp8.enabled=true: needs torchao, which does not import here ({exc}). "
        "Install it with `pip install 'zeroshard[fp8]'`, or set zeroshard.fp8.enabled=false."
    ) from exc
finally:
    _torchao_log.setLevel(_level)

__all__ = ["FP8_GATHERED", "Fp8Linear", "fp8_cast", "fp8_device_problem", "fp8_scale", "swap_to_fp8"]

# The attribute a stage-3 fp8 gather sets on a weight Parameter: (fp8 data, 0-d fp32 scale).
FP8_GATHERED = "zeroshard_fp8_gathered"
E4M3 = torch.float8_e4m3fn


def torchao_config(settings: Fp8Settings) -> Float8LinearConfig:
    """torchao's config for the recipe, with emulation as the settings say."""
    return dataclasses.replace(Float8LinearConfig.from_recipe_name(settings.recipe), emulate=settings.emulate)


def fp8_device_problem(device: torch.device, settings: Fp8Settings) -> str | None:
    """Why fp8 matmuls cannot run on `device` outside emulation (None: they can)."""
    if settings.emulate:
        return None
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) >= (8, 9):
            return None
        what = f"{torch.cuda.get_device_name(device)} (compute capability {major}.{minor})"
    else:
        what = f"the {device.type} device"
    return (
        f"zeroshard.fp8.emulate=false: {what} has no fp8 matmul (it needs an NVIDIA GPU of compute capability "
        "8.9 or newer: Ada, Hopper, Blackwell). Set zeroshard.fp8.emulate=true to run torchao's emulation "
        "(fp8 values, fp32 matmuls: for tests, slow), or zeroshard.fp8.enabled=false."
    )


@torch._dynamo.allow_in_graph
class _GatheredWeight(torch.autograd.Function):
    """The fp8 weight from gathered bytes and their scale; its gradient goes to the Parameter
    (a straight-through conversion, as torchao's own cast of the weight is)."""

    @staticmethod
    def forward(ctx, weight, data, scale, mm_config):
        return Float8TrainingTensor(data, scale, weight.dtype, mm_config, GemmInputRole.WEIGHT)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None, None


class Fp8Linear(Float8Linear):
    """torchao's Float8Linear that also computes from a weight gathered in fp8 (stage 3)."""

    zeroshard_fp8 = True  # fp8_linear_plan: already swapped

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        gathered = getattr(self.weight, FP8_GATHERED, None)
        if gathered is None:
            return super().forward(input)
        data, scale = gathered
        weight = _GatheredWeight.apply(self.weight, data, scale, self.linear_mm_config)
        output = matmul_with_hp_or_float8_args.apply(input, weight.t(), self.linear_mm_config, self.config)
        if self.bias is not None:
            output = output + self.bias.to(output.dtype)
        return output


def swap_to_fp8(model: nn.Module, settings: Fp8Settings) -> list[str]:
    """Replace every Linear `fp8_linear_plan` chose with an `Fp8Linear` holding the same
    Parameters (in place, as torchao's convert_to_float8_training does). Returns their names."""
    config = torchao_config(settings)
    swapped = []
    for choice in fp8_linear_plan(model, settings):
        module = model.get_submodule(choice.name)
        if not choice.fp8 or isinstance(module, Fp8Linear):
            continue
        with torch.device("meta"):
            fp8 = Fp8Linear(choice.in_features, choice.out_features, bias=False, config=config)
        fp8.weight = module.weight
        fp8.bias = module.bias
        fp8.train(module.training)
        parent_name, _, leaf = choice.name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, leaf, fp8)
        swapped.append(choice.name)
    return swapped


@torch.no_grad()
def fp8_scale(amax: torch.Tensor) -> torch.Tensor:
    """torchao's tensorwise weight scale for an amax (fp32; e4m3's largest value / amax)."""
    return amax_to_scale(amax, E4M3)


@torch.no_grad()
def fp8_cast(values: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> None:
    """Write `values` scaled and saturated to e4m3 into `out`, as torchao casts a weight."""
    out.copy_(to_fp8_saturated(values.to(torch.float32) * scale, E4M3))
