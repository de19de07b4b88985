"""Which Linear layers compute in fp8, and why the others do not (the plan's fp8 role).

[Note: fp8 compute]
`zeroshard.fp8` keeps the bf16 mode's parameters, gradients, masters and optimizer state, and
changes how some `torch.nn.Linear` layers multiply: torchao's float8 training casts the
input, the weight and the output gradient to fp8 with a dynamic scale (one per tensor, or one
per row with the "rowwise" recipe) and runs the three matmuls of a Linear (output, input
gradient, weight gradient) on fp8 operands, accumulating in fp32 and returning bf16. The
weights of those layers form the precision role "fp8" (a parameter group of the plan): bf16
parameters, fp8 compute, and at stage 3 with the tensorwise recipe an fp8 all-gather
(zeroshard/sharding/fp8_gather.py's [Note: fp8 gathers]). Everything else (biases, norms,
embeddings and the Linears this file leaves out) is the "all" group, computed in bf16.

A Linear computes in fp8 when all of these hold (`fp8_linear_plan` says which failed):
* its class is exactly `torch.nn.Linear` (a subclass has a forward of its own, which the
  swap would drop);
* its name matches no pattern of `zeroshard.fp8.exclude_modules`;
* it is not the model's output layer (the LM head: `get_output_embeddings()` where the model
  has it, else the last Linear in module order), whose logits feed the loss directly;
* its weight is not shared with another module (a tied embedding keeps one dtype);
* in_features and out_features are both at least `min_features` and multiples of 16 (fp8
  matmul kernels need multiples of 16; small matmuls lose more to the casts than they gain).

This module is pure (no torchao, no process group): `explain` runs it on a meta-device model.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

from torch import nn

__all__ = ["Fp8Choice", "Fp8Settings", "fp8_linear_plan", "fp8_weight_ids"]

# Every fp8 matmul operand dimension must be a multiple of this (torch._scaled_mm).
FP8_DIM_MULTIPLE = 16


@dataclass(frozen=True)
class Fp8Settings:
    """The resolved `zeroshard.fp8` section (None in the plan when fp8 is off)."""

    recipe: str
    min_features: int
    emulate: bool
    exclude_modules: tuple[str, ...]


@dataclass(frozen=True)
class Fp8Choice:
    """One Linear layer of the model and whether it computes in fp8."""

    name: str
    in_features: int
    out_features: int
    fp8: bool
    reason: str


def _output_layer(model: nn.Module) -> nn.Module | None:
    getter = getattr(model, "get_output_embeddings", None)
    if callable(getter):
        try:
            head = getter()
        except (NotImplementedError, AttributeError):
            head = None
        if isinstance(head, nn.Linear):
            return head
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    return linears[-1] if linears else None


def _owners(model: nn.Module) -> dict[int, list[str]]:
    owners: dict[int, list[str]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        for p in module._parameters.values():
            if p is not None and name not in owners.setdefault(id(p), []):
                owners[id(p)].append(name)
    return owners


def fp8_linear_plan(model: nn.Module, settings: Fp8Settings) -> list[Fp8Choice]:
    """Every `torch.nn.Linear` (subclasses included) of `model`, in module order, with the
    decision of [Note: fp8 compute] and its reason. Works on a meta-device model."""
    head = _output_layer(model)
    owners = _owners(model)
    choices = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        n_in, n_out = module.in_features, module.out_features
        pattern = next((p for p in settings.exclude_modules if fnmatch.fnmatchcase(name, p)), None)
        shared = [o for o in owners.get(id(module.weight), []) if o != name]
        if getattr(module, "zeroshard_fp8", False):
            fp8, reason = True, "already swapped for fp8 compute"
        elif type(module) is not nn.Linear:
            fp8, reason = False, f"{type(module).__name__} is a subclass of nn.Linear with a forward of its own"
        elif pattern is not None:
            fp8, reason = False, f'listed in zeroshard.fp8.exclude_modules ("{pattern}")'
        elif module is head:
            fp8, reason = False, "the output layer (LM head)"
        elif shared:
            fp8, reason = False, f"weight shared with {shared[0]}"
        elif min(n_in, n_out) < settings.min_features:
            fp8, reason = False, f"smaller than zeroshard.fp8.min_features={settings.min_features}"
        elif n_in % FP8_DIM_MULTIPLE or n_out % FP8_DIM_MULTIPLE:
            fp8, reason = False, f"in/out features not multiples of {FP8_DIM_MULTIPLE} (fp8 matmul kernels need it)"
        else:
            fp8, reason = True, f"{n_in} x {n_out}, {settings.recipe} scaling"
        choices.append(Fp8Choice(name, n_in, n_out, fp8, reason))
    return choices


def fp8_weight_ids(model: nn.Module, settings: Fp8Settings) -> set[int]:
    """ids of the weights of the Linears that compute in fp8."""
    chosen = {c.name for c in fp8_linear_plan(model, settings) if c.fp8}
    return {id(model.get_submodule(name).weight) for name in chosen}


def unmatched_patterns(model: nn.Module, settings: Fp8Settings) -> list[str]:
    """exclude_modules patterns that match no Linear of the model (a typo would otherwise
    silently keep a layer in fp8)."""
    names = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    return [p for p in settings.exclude_modules if not any(fnmatch.fnmatchcase(n, p) for n in names)]
