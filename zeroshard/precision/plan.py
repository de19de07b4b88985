"""Resolve a config into a PrecisionPlan: one dtype per tensor role per parameter group.

[Note: dtypes]
The vocabulary used everywhere in zeroshard (docs/design.md section 2):

* ``param_dtype``: the module parameters, what forward sees.
* ``compute``: how forward computes ("fp32", "bf16", "fp16", or "autocast(bf16)" for
  torch.autocast's op policy). A label for people, not a dtype.
* ``grad_dtype``: the gradient autograd produces (the parameter's dtype).
* ``grad_accum_dtype``: the buffer micro-batch gradients are summed into between optimizer
  steps (``data_types.grad_accum_dtype``; fp32 unless the user lowers it).
* ``reduce_dtype``: the dtype on the wire for all-reduce / reduce-scatter.
* ``gather_dtype``: the dtype on the wire for parameter all-gathers (stage 3 before forward,
  stages 1-2 after the step).
* ``master_dtype``: the weights the optimizer updates. In fp32 and torch_autocast modes the
  master weights ARE the parameters (``master_is_param``); no extra copy exists.
* ``optimizer_state_dtype``: Adam moments, momentum buffers.

Exactly one mode is chosen by the config: "fp32", "bf16", "fp16" or "torch_autocast". In
torch_autocast mode there are two parameter groups: parameters owned by the
``lower_precision_safe_modules`` (reduced and gathered in the autocast dtype) and the rest
(reduced and gathered in fp32). Other modes have one group, "all". ``bf16`` together with
``torch_autocast`` (dtype bf16) is bf16 mode with autocast's op policy for the compute
(DeepSpeed accepts it): bf16 parameters, the precision-sensitive ops in fp32.

``zeroshard.fp8`` (bf16 mode only) adds a group "fp8": the weights of the Linears that
compute in fp8 (zeroshard/precision/fp8.py's [Note: fp8 compute]); at stage 3 with the
tensorwise recipe their gather dtype is ``float8_e4m3fn``.

Lossy choices a user may make to save memory or bandwidth are allowed and listed in
``PrecisionPlan.lossy`` (``explain`` marks them, ``resolve_config`` warns once): accumulating
in a dtype narrower than the gradient's, and communicating in one narrower than the
accumulation's.

This module is pure: it needs no process group, and the plan is the same on every rank.
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass, field

import torch
from torch import nn

from zeroshard.config.schema import (
    DEFAULT_LOWER_PRECISION_SAFE_MODULES,
    ConfigError,
    ZeroshardConfig,
    canonical_dtype_name,
)
from zeroshard.precision.fp8 import Fp8Settings, fp8_weight_ids

__all__ = [
    "LossScaleSettings",
    "PrecisionPlan",
    "RolePlan",
    "assign_param_groups",
    "dtype_name",
    "resolve_precision_plan",
    "resolve_module_class",
]

_TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
_NAMES = {v: k for k, v in _TORCH_DTYPES.items()}
# torch.amp.GradScaler's defaults, used for torch_autocast with fp16.
_GRAD_SCALER_INIT = 2.0**16
_GRAD_SCALER_GROWTH_INTERVAL = 2000

GROUP_ALL = "all"
GROUP_SAFE = "lower_precision_safe"
GROUP_OTHER = "other"
GROUP_FP8 = "fp8"
FP8_WIRE_DTYPE = torch.float8_e4m3fn


_SKIP_KEY = "zeroshard.skip_nonfinite_steps"


def dtype_name(dtype: torch.dtype) -> str:
    """Short name of a floating dtype: "fp32", "bf16" or "fp16"."""
    return _NAMES.get(dtype, str(dtype).removeprefix("torch."))


def _torch_dtype(name: str) -> torch.dtype:
    return _TORCH_DTYPES[canonical_dtype_name(name)]


@dataclass(frozen=True)
class RolePlan:
    """One parameter group's resolved dtypes (see [Note: dtypes])."""

    name: str
    param_dtype: torch.dtype
    compute: str
    grad_dtype: torch.dtype
    grad_accum_dtype: torch.dtype
    reduce_dtype: torch.dtype
    gather_dtype: torch.dtype
    master_dtype: torch.dtype
    optimizer_state_dtype: torch.dtype
    master_is_param: bool

    def as_dict(self) -> dict[str, object]:
        """Printable form: dtype names instead of torch dtypes."""
        return {
            "param": dtype_name(self.param_dtype),
            "compute": self.compute,
            "grad": dtype_name(self.grad_dtype),
            "grad_accum": dtype_name(self.grad_accum_dtype),
            "reduce": dtype_name(self.reduce_dtype),
            "gather": dtype_name(self.gather_dtype),
            "master": "the params" if self.master_is_param else dtype_name(self.master_dtype),
            "optimizer_state": dtype_name(self.optimizer_state_dtype),
        }


@dataclass(frozen=True)
class LossScaleSettings:
    """How the loss is scaled before backward.

    Attributes:
        kind: "none", "static", "dynamic" (DeepSpeed's dynamic scaler) or "grad_scaler"
            (torch.amp.GradScaler semantics, torch_autocast with fp16).
        init_scale: the first (or the static) scale.
        window: clean steps before the scale doubles.
        hysteresis: overflows tolerated before the scale halves.
        min_scale: the scale never goes below this.
        consecutive_hysteresis: refill the hysteresis after a clean step.
    """

    kind: str
    init_scale: float = 1.0
    window: int = 1000
    hysteresis: int = 2
    min_scale: float = 1.0
    consecutive_hysteresis: bool = False


@dataclass(frozen=True)
class PrecisionPlan:
    """The resolved precision of a run. ``engine.precision_plan`` is one of these.

    Attributes:
        mode: "fp32", "bf16", "fp16" or "torch_autocast".
        autocast_dtype: the torch.autocast dtype in torch_autocast mode, else None.
        safe_module_classes: the resolved lower_precision_safe_modules (torch_autocast only).
        groups: "all", or "lower_precision_safe" and "other" in torch_autocast mode.
        loss_scale: loss-scaling settings.
        check_grad_overflow: whether a step with a non-finite gradient is skipped.
        overflow_keys: the config key(s) that turn `check_grad_overflow` off ("" when
            nothing can: fp16's loss scaling needs the check).
        notes: deliberate choices worth telling the user (printed by explain).
        lossy: the lossy choices the config makes (narrower accumulation or wire dtype), one
            sentence each naming the key (explain marks them; initialize warns once).
        buffer_dtype: the dtype floating buffers are cast to (``data_types.buffer_dtype``);
            None keeps each buffer's own dtype, in every mode (a rotary ``inv_freq`` stays fp32
            in bf16 training).
        fp8: the ``zeroshard.fp8`` settings when fp8 compute is on (group "fp8"), else None.
    """

    mode: str
    autocast_dtype: torch.dtype | None
    safe_module_classes: tuple[type, ...]
    groups: dict[str, RolePlan]
    loss_scale: LossScaleSettings
    check_grad_overflow: bool
    overflow_keys: str = ""
    notes: list[str] = field(default_factory=list)
    lossy: list[str] = field(default_factory=list)
    buffer_dtype: torch.dtype | None = None
    fp8: Fp8Settings | None = None

    def group_for_module(self, module: nn.Module) -> RolePlan:
        """The group of the parameters that ``module`` owns directly."""
        if self.mode != "torch_autocast":
            return self.groups[GROUP_ALL]
        if isinstance(module, self.safe_module_classes):
            return self.groups[GROUP_SAFE]
        return self.groups[GROUP_OTHER]

    def as_dict(self) -> dict[str, object]:
        """JSON-ready description (dtype names as strings)."""
        return {
            "mode": self.mode,
            "autocast_dtype": dtype_name(self.autocast_dtype) if self.autocast_dtype else None,
            "safe_module_classes": [f"{c.__module__}.{c.__qualname__}" for c in self.safe_module_classes],
            "groups": {name: plan.as_dict() for name, plan in self.groups.items()},
            "loss_scale": {
                "kind": self.loss_scale.kind,
                "init_scale": self.loss_scale.init_scale,
                "window": self.loss_scale.window,
                "hysteresis": self.loss_scale.hysteresis,
                "min_scale": self.loss_scale.min_scale,
                "consecutive_hysteresis": self.loss_scale.consecutive_hysteresis,
            },
            "check_grad_overflow": self.check_grad_overflow,
            "overflow_keys": self.overflow_keys,
            "notes": list(self.notes),
            "lossy": list(self.lossy),
            "buffers": dtype_name(self.buffer_dtype) if self.buffer_dtype else "own dtype",
            "fp8": None if self.fp8 is None else {
                "recipe": self.fp8.recipe, "min_features": self.fp8.min_features, "emulate": self.fp8.emulate,
                "exclude_modules": list(self.fp8.exclude_modules),
            },
        }


def resolve_module_class(dotted: str, key: str) -> type[nn.Module]:
    """Import ``package.module.ClassName`` and check it is an nn.Module subclass.

    Args:
        dotted: the dotted class name, e.g. "torch.nn.Linear".
        key: the config path to name in the error.

    Raises:
        ConfigError: naming ``key`` and ``dotted`` when it does not import or is no module class.
    """
    module_name, _, attr = dotted.rpartition(".")
    if not module_name:
        raise ConfigError(
            f'{key}="{dotted}": needs a dotted class name, e.g. "torch.nn.Linear" or "mypkg.layers.MyLinear".'
        )
    try:
        obj = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(
            f'{key}="{dotted}": does not import ({type(exc).__name__}: {exc}). '
            "Give the full dotted path of a class that is importable here."
        ) from None
    if not (isinstance(obj, type) and issubclass(obj, nn.Module)):
        raise ConfigError(f'{key}="{dotted}": is not a torch.nn.Module subclass. Name a module class.')
    return obj


def _mode(config: ZeroshardConfig, problems: list[str]) -> str:
    fp16, bf16, autocast = config.fp16.enabled, config.bf16.enabled, config.torch_autocast.enabled
    if fp16 and bf16:
        problems.append("bf16.enabled and fp16.enabled are both true: pick one precision.")
    if autocast and fp16:
        problems.append(
            "torch_autocast.enabled and fp16.enabled are both true: torch_autocast keeps fp32 parameters "
            "and casts per op, fp16 makes the parameters fp16 with loss scaling. Pick one: set "
            "fp16.enabled to false, or torch_autocast.enabled to false."
        )
    if autocast and bf16 and not fp16:
        if canonical_dtype_name(config.torch_autocast.dtype) != "bf16":
            problems.append(
                f'torch_autocast.dtype="{config.torch_autocast.dtype}": with bf16.enabled the parameters are '
                "bf16, so autocast can only compute in bf16. Set torch_autocast.dtype to \"bfloat16\", or "
                "disable one of the two sections."
            )
        return "bf16"  # bf16 parameters, autocast's op policy for the compute
    if autocast:
        return "torch_autocast"
    if fp16:
        return "fp16"
    if bf16:
        return "bf16"
    return "fp32"


_WIDTH = {"fp32": 32, "bf16": 16, "fp16": 16}


def _narrower(a: str, b: str) -> bool:
    """Whether dtype ``a`` loses values of dtype ``b``: fewer bits, or the other 16-bit kind
    (bf16 and fp16 trade range for mantissa: neither holds the other)."""
    return a != b and _WIDTH[a] <= _WIDTH[b]


def _check_bf16_options(config: ZeroshardConfig, problems: list[str]) -> None:
    bf16 = config.bf16
    if bf16.bf16_master_weights_and_grads and not bf16.enabled:
        problems.append(
            "bf16.bf16_master_weights_and_grads=true: applies only with bf16.enabled=true. "
            "Enable bf16, or remove the option."
        )
    if bf16.bf16_optimizer_states and not bf16.enabled:
        problems.append(
            "bf16.bf16_optimizer_states=true: applies only with bf16.enabled=true. "
            "Enable bf16, or remove the option."
        )
    elif bf16.bf16_optimizer_states and not bf16.bf16_master_weights_and_grads:
        problems.append(
            "bf16.bf16_optimizer_states=true: needs bf16.bf16_master_weights_and_grads=true (as in "
            "DeepSpeed: bf16 optimizer states beside fp32 master weights gain nothing). Set both, or neither."
        )


def _fp8_settings(config: ZeroshardConfig, mode: str, problems: list[str]) -> Fp8Settings | None:
    """The fp8 section when enabled, after the rules across sections (bf16 mode only)."""
    fp8 = config.zeroshard.fp8
    if not fp8.enabled:
        return None
    if config.fp16.enabled:
        problems.append(
            "zeroshard.fp8.enabled=true: fp8 compute sits on bf16 parameters and fp32 master weights, and "
            "fp16.enabled=true makes the parameters fp16 with loss scaling (torchao's float8 training keeps "
            "bf16 outputs and gradients). Set bf16.enabled=true and fp16.enabled=false, or zeroshard.fp8.enabled=false."
        )
    elif config.torch_autocast.enabled:
        problems.append(
            "zeroshard.fp8.enabled=true: not with torch_autocast.enabled=true (the fp8 Linears cast their own "
            "operands; autocast's op policy would recast their inputs). Set torch_autocast.enabled=false and "
            "bf16.enabled=true, or zeroshard.fp8.enabled=false."
        )
    elif mode != "bf16":
        problems.append(
            "zeroshard.fp8.enabled=true: needs bf16.enabled=true (fp8 compute sits on bf16 parameters and fp32 "
            "master weights). Set bf16.enabled=true, or zeroshard.fp8.enabled=false."
        )
    return Fp8Settings(fp8.recipe, fp8.min_features, fp8.emulate, tuple(fp8.exclude_modules))


def _fp8_role(config: ZeroshardConfig, settings: Fp8Settings, base: RolePlan, notes: list[str]) -> RolePlan:
    """The "fp8" group: the bf16 group's dtypes, fp8 compute, and at stage 3 (tensorwise, the
    parameters on the device) an fp8 gather."""
    zero = config.zero_optimization
    gather = base.gather_dtype
    compute = f"fp8 e4m3 ({settings.recipe}{', emulated' if settings.emulate else ''})"
    if zero.stage == 3 and settings.recipe == "tensorwise" and not zero.param_offload:
        gather = FP8_WIRE_DTYPE
        notes.append(
            "fp8: stage 3 gathers the fp8 Linears' weights in float8_e4m3fn with one scale per weight "
            "(one amax all-reduce per step), half the bytes of bf16; they are computed from those bytes."
        )
    elif zero.stage == 3 and settings.recipe == "rowwise":
        notes.append(
            "fp8: the rowwise recipe scales a weight per row in forward and per column in backward, so no "
            "one fp8 copy serves both: stage 3 gathers these weights in bf16 (as torchao's FSDP2 path does)."
        )
    elif zero.stage == 3:
        notes.append("fp8: with offload_param the gathers start from the host in bf16 (no fp8 gather).")
    return dataclasses.replace(base, name=GROUP_FP8, compute=compute, gather_dtype=gather)


def _wire_dtype(config: ZeroshardConfig) -> str | None:
    requested = config.communication_data_type
    return None if requested is None else canonical_dtype_name(requested)


def _resolve_safe_classes(config: ZeroshardConfig, problems: list[str]) -> tuple[type, ...]:
    names = config.torch_autocast.lower_precision_safe_modules
    if names is None:
        names = list(DEFAULT_LOWER_PRECISION_SAFE_MODULES)
    classes = []
    for name in names:
        try:
            classes.append(resolve_module_class(name, "torch_autocast.lower_precision_safe_modules"))
        except ConfigError as exc:
            problems.extend(exc.problems)
    return tuple(classes)


def resolve_precision_plan(config: ZeroshardConfig) -> PrecisionPlan:
    """Resolve the precision of every tensor role for every parameter group.

    Args:
        config: a config checked key by key (``resolve_config`` passes its own, before the plan is set).

    Returns:
        The plan; the same on every rank.

    Raises:
        ConfigError: listing every precision rule the config breaks, each naming its key.
    """
    problems: list[str] = []
    mode = _mode(config, problems)
    _check_bf16_options(config, problems)
    fp8 = _fp8_settings(config, mode, problems)
    wire = _wire_dtype(config)
    requested_accum = config.data_types.grad_accum_dtype
    accum_name = None if requested_accum is None else canonical_dtype_name(requested_accum)

    autocast_dtype = None
    safe_classes: tuple[type, ...] = ()
    if mode == "bf16" and config.torch_autocast.enabled:
        autocast_dtype = torch.bfloat16
        # One group here (every parameter is bf16), but a bad class name is still an error.
        _resolve_safe_classes(config, problems)
    if mode == "torch_autocast":
        autocast_name = canonical_dtype_name(config.torch_autocast.dtype)
        if autocast_name == "fp32":
            problems.append(
                f'torch_autocast.dtype="{config.torch_autocast.dtype}": autocast to fp32 changes nothing. '
                'Use "bfloat16" or "float16", or set torch_autocast.enabled to false.'
            )
        else:
            autocast_dtype = _TORCH_DTYPES[autocast_name]
        safe_classes = _resolve_safe_classes(config, problems)
    if problems:
        raise ConfigError(problems)

    notes: list[str] = []
    fp32 = torch.float32
    # A non-finite global norm skips the step in every mode unless the user turns it off;
    # fp16's loss scaling cannot work without the check, so nothing turns it off there.
    skip_nonfinite = config.zeroshard.skip_nonfinite_steps
    overflow_keys = ""
    if mode == "fp32":
        accum = _torch_dtype(accum_name) if accum_name else fp32
        reduce = _TORCH_DTYPES[wire] if wire is not None else accum
        groups = {GROUP_ALL: RolePlan(GROUP_ALL, fp32, "fp32", fp32, accum, reduce, fp32, fp32, fp32, True)}
        loss_scale = LossScaleSettings(kind="none")
        check_overflow = skip_nonfinite
        overflow_keys = _SKIP_KEY
    elif mode in ("bf16", "fp16"):
        low = _TORCH_DTYPES[mode]
        low_masters = mode == "bf16" and config.bf16.bf16_master_weights_and_grads
        if requested_accum is not None:
            accum = _torch_dtype(requested_accum)
        elif low_masters:
            accum = low  # "master weights AND grads" in bf16: the accumulation buffer is the master grad
            notes.append(
                "bf16_master_weights_and_grads: gradients accumulate in bf16 (set "
                "data_types.grad_accum_dtype=fp32 to accumulate in fp32 instead)."
            )
        else:
            accum = fp32
            notes.append(
                f"Gradients accumulate and are reduced in fp32 (DeepSpeed's default is {mode} for both); "
                f'"data_types": {{"grad_accum_dtype": "{mode}"}} restores DeepSpeed\'s behaviour, and '
                f'"communication_data_type": "{mode}" halves the reduce bytes.'
            )
        reduce = _TORCH_DTYPES[wire] if wire is not None else accum
        master = low if low_masters else fp32
        state = low if (mode == "bf16" and config.bf16.bf16_optimizer_states) else fp32
        compute = f"autocast({mode})" if autocast_dtype is not None else mode
        groups = {GROUP_ALL: RolePlan(GROUP_ALL, low, compute, low, accum, reduce, low, master, state, False)}
        if mode == "fp16":
            fp16 = config.fp16
            if fp16.loss_scale > 0:
                loss_scale = LossScaleSettings(
                    kind="static", init_scale=float(fp16.loss_scale), window=fp16.loss_scale_window,
                    hysteresis=fp16.hysteresis, min_scale=float(fp16.min_loss_scale),
                    consecutive_hysteresis=fp16.consecutive_hysteresis,
                )
            else:
                loss_scale = LossScaleSettings(
                    kind="dynamic", init_scale=2.0**fp16.initial_scale_power, window=fp16.loss_scale_window,
                    hysteresis=fp16.hysteresis, min_scale=float(fp16.min_loss_scale),
                    consecutive_hysteresis=fp16.consecutive_hysteresis,
                )
            check_overflow = True
        else:
            loss_scale = LossScaleSettings(kind="none")
            check_overflow = config.bf16.check_grad_overflow and skip_nonfinite
            overflow_keys = f"bf16.check_grad_overflow, {_SKIP_KEY}"
    else:
        assert autocast_dtype is not None
        low_name = dtype_name(autocast_dtype)
        compute = f"autocast({low_name})"
        accum = _torch_dtype(accum_name) if accum_name else fp32
        # The safe group is reduced in the autocast dtype, the rest in the accumulation dtype,
        # unless communication_data_type names the wire dtype for both.
        safe_wire = _TORCH_DTYPES[wire] if wire is not None else autocast_dtype
        other_wire = _TORCH_DTYPES[wire] if wire is not None else accum
        groups = {
            GROUP_SAFE: RolePlan(
                GROUP_SAFE, fp32, compute, fp32, accum, safe_wire, autocast_dtype, fp32, fp32, True
            ),
            GROUP_OTHER: RolePlan(GROUP_OTHER, fp32, compute, fp32, accum, other_wire, fp32, fp32, fp32, True),
        }
        if autocast_dtype == torch.float16:
            loss_scale = LossScaleSettings(
                kind="grad_scaler", init_scale=_GRAD_SCALER_INIT, window=_GRAD_SCALER_GROWTH_INTERVAL,
                hysteresis=1, min_scale=0.0,
            )
            check_overflow = True
        else:
            loss_scale = LossScaleSettings(kind="none")
            check_overflow = skip_nonfinite
            overflow_keys = _SKIP_KEY
        notes.append(
            f"Parameters of {', '.join(c.__name__ for c in safe_classes) or 'no module class'} are "
            f"reduced and gathered in {low_name}; all other parameters in fp32. A parameter shared "
            "with a module outside that list stays fp32."
        )
    if fp8 is not None:
        groups[GROUP_FP8] = _fp8_role(config, fp8, groups[GROUP_ALL], notes)
    return PrecisionPlan(
        mode=mode,
        autocast_dtype=autocast_dtype,
        safe_module_classes=safe_classes,
        groups=groups,
        loss_scale=loss_scale,
        check_grad_overflow=check_overflow,
        overflow_keys=overflow_keys,
        notes=notes,
        lossy=_lossy_choices(config, groups),
        buffer_dtype=_torch_dtype(config.data_types.buffer_dtype) if config.data_types.buffer_dtype else None,
        fp8=fp8,
    )


def _lossy_choices(config: ZeroshardConfig, groups: dict[str, RolePlan]) -> list[str]:
    """One sentence per lossy choice the user made (the defaults are never lossy)."""
    lossy: list[str] = []
    requested_accum = config.data_types.grad_accum_dtype
    for role in groups.values():
        grad, accum = dtype_name(role.grad_dtype), dtype_name(role.grad_accum_dtype)
        if requested_accum is not None and _narrower(accum, grad):
            sentence = (
                f'data_types.grad_accum_dtype="{requested_accum}": {grad} gradients are accumulated in {accum}, '
                "which rounds them at every micro-batch (lossy; fp32 accumulation is exact)."
            )
            if sentence not in lossy:
                lossy.append(sentence)
        wire = dtype_name(role.reduce_dtype)
        if config.communication_data_type is not None and _narrower(wire, accum):
            sentence = (
                f'communication_data_type="{config.communication_data_type}": gradients accumulated in {accum} '
                f"are reduced in {wire}, rounded once per reduction (lossy; saves bandwidth)."
            )
            if sentence not in lossy:
                lossy.append(sentence)
    return lossy


def assign_param_groups(plan: PrecisionPlan, model: nn.Module) -> dict[str, str]:
    """Map each parameter name to its group name.

    Names are those of ``model.named_parameters(remove_duplicate=True)``. A parameter owned
    directly by several modules (tied weights) is "lower_precision_safe" only if every owner is
    a safe module; otherwise it is "other", so a tied embedding/lm-head weight stays fp32.
    """
    if plan.fp8 is not None:  # the weights of the fp8 Linears, [Note: fp8 compute]
        fp8 = fp8_weight_ids(model, plan.fp8)
        return {name: GROUP_FP8 if id(p) in fp8 else GROUP_ALL for name, p in model.named_parameters()}
    if plan.mode != "torch_autocast":
        return {name: GROUP_ALL for name, _ in model.named_parameters()}
    all_owners_safe: dict[int, bool] = {}
    for module in model.modules():
        safe = plan.group_for_module(module).name == GROUP_SAFE
        for param in module.parameters(recurse=False):
            all_owners_safe[id(param)] = all_owners_safe.get(id(param), True) and safe
    return {
        name: GROUP_SAFE if all_owners_safe[id(param)] else GROUP_OTHER
        for name, param in model.named_parameters()
    }
