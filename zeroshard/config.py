"""The DeepSpeed JSON config subset zeroshard understands, as pydantic models.

Every key a user can write falls in exactly one of three classes (DESIGN section 1):

* supported: a field of one of the models below, with DeepSpeed 0.19's documented default;
* accepted, no effect: a tuning or logging knob that changes no result here. It is accepted,
  listed in ``ZeroshardConfig.no_effect_keys`` (``zeroshard explain`` prints it) and warned
  about once when set to something other than its default;
* not supported: a DeepSpeed feature that would change results or memory. It is an error
  naming the key, unless it is set to its inert value (``"offload_optimizer": {"device":
  "none"}``, ``"prescale_gradients": false``), which counts as accepted, no effect.

Anything else is an unknown key and gets a "did you mean" error. ``"auto"`` (what the Hugging
Face integration writes for values it fills in) is an error that names the key. All problems are
collected and raised together in one ``ConfigError`` whose lines read
``<json.path>=<value>: <rule>. <fix>``.
"""

from __future__ import annotations

import copy
import difflib
import json
import os
import typing
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator

__all__ = [
    "BF16Config",
    "ConfigError",
    "DEFAULT_LOWER_PRECISION_SAFE_MODULES",
    "DataTypesConfig",
    "FP16Config",
    "OptimizerConfig",
    "SchedulerConfig",
    "TorchAutocastConfig",
    "ZeroConfig",
    "ZeroshardConfig",
    "ZeroshardExtras",
    "canonical_dtype_name",
    "load_config",
]


class ConfigError(ValueError):
    """A config the user gave cannot be used. The message lists every problem, one per line.

    Attributes:
        problems: one entry per problem, each starting with the JSON path of the key.
    """

    def __init__(self, problems: list[str] | str):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        if len(self.problems) == 1:
            message = self.problems[0]
        else:
            message = "invalid config:\n" + "\n".join(f"  {p}" for p in self.problems)
        super().__init__(message)


# ---------------------------------------------------------------------------------------------
# dtype names
# ---------------------------------------------------------------------------------------------

_DTYPE_ALIASES = {
    "fp32": "fp32",
    "float32": "fp32",
    "float": "fp32",
    "fp16": "fp16",
    "float16": "fp16",
    "half": "fp16",
    "bf16": "bf16",
    "bfloat16": "bf16",
}


def canonical_dtype_name(name: str) -> str:
    """Map any accepted dtype spelling to "fp32", "fp16" or "bf16".

    Accepts "fp32"/"float32", "fp16"/"float16"/"half", "bf16"/"bfloat16", with or without a
    "torch." prefix (DeepSpeed's own tests write ``str(torch.bfloat16)``).

    Raises:
        ValueError: for any other name.
    """
    key = str(name).strip().lower().removeprefix("torch.")
    if key not in _DTYPE_ALIASES:
        raise ValueError(
            f"unknown dtype {name!r}; use one of 'fp32', 'fp16', 'bf16' "
            "(or 'float32', 'float16', 'half', 'bfloat16')"
        )
    return _DTYPE_ALIASES[key]


def _validate_dtype_name(value: str | None) -> str | None:
    if value is None:
        return None
    canonical_dtype_name(value)
    return value


# ---------------------------------------------------------------------------------------------
# Key classes
# ---------------------------------------------------------------------------------------------


class _Unsupported(NamedTuple):
    """A recognised DeepSpeed key we do not implement.

    Attributes:
        is_inert: True for a value that asks for nothing (the feature switched off); such a
            value is accepted as "no effect".
        hint: what to do instead.
    """

    is_inert: Callable[[Any], bool]
    hint: str = "Remove it."


def _equals(*inert_values: Any) -> Callable[[Any], bool]:
    return lambda v: any(type(v) is type(i) and v == i for i in inert_values) or (
        # JSON writes 1.0 and 1 interchangeably
        isinstance(v, (int, float)) and not isinstance(v, bool)
        and any(isinstance(i, (int, float)) and not isinstance(i, bool) and v == i for i in inert_values)
    )


def _disabled_section(v: Any) -> bool:
    return v is None or (isinstance(v, dict) and not v.get("enabled", False))


def _offload_off(v: Any) -> bool:
    return v is None or (isinstance(v, dict) and str(v.get("device", "none")).lower() == "none")


def _empty(v: Any) -> bool:
    return v is None or v == {} or v == []


class _Section(BaseModel):
    """Base of every config section: unknown keys are refused (with "did you mean")."""

    model_config = ConfigDict(extra="forbid", validate_default=True)

    # Field names that are accepted tuning knobs with no effect on any result.
    NO_EFFECT: ClassVar[frozenset[str]] = frozenset()
    # Recognised DeepSpeed keys we do not implement (not fields).
    NOT_SUPPORTED: ClassVar[dict[str, _Unsupported]] = {}
    # Fields whose default is not worth listing among "defaults applied".
    UNLISTED_DEFAULTS: ClassVar[frozenset[str]] = frozenset()

    @classmethod
    def json_keys(cls) -> list[str]:
        """Every key this section recognises, in any class."""
        return [*cls.model_fields, *cls.NOT_SUPPORTED]

    @classmethod
    def check_extra(cls, raw: dict[str, Any], path: str, report: _Report) -> None:
        """Section-specific checks of the raw dict (e.g. optimizer params); override."""


# ---------------------------------------------------------------------------------------------
# Sections
# ---------------------------------------------------------------------------------------------

_SUPPORTED_OPTIMIZERS = {"adam": "Adam", "adamw": "AdamW", "sgd": "SGD", "muon": "Muon"}
_UNSUPPORTED_OPTIMIZERS = {
    "adagrad": "Adagrad",
    "lamb": "Lamb",
    "onebitadam": "OneBitAdam",
    "zerooneadam": "ZeroOneAdam",
    "onebitlamb": "OneBitLamb",
    "lion": "Lion",
    "muadam": "MuAdam",
    "muadamw": "MuAdamW",
    "musgd": "MuSGD",
}
# Parameter names checked for typos; None = passed through to the optimizer unchecked.
_OPTIMIZER_PARAMS: dict[str, frozenset[str] | None] = {
    "adam": frozenset({"lr", "betas", "eps", "weight_decay", "amsgrad", "adam_w_mode", "torch_adam"}),
    "adamw": frozenset({"lr", "betas", "eps", "weight_decay", "amsgrad", "adam_w_mode", "torch_adam"}),
    "sgd": frozenset({"lr", "momentum", "dampening", "weight_decay", "nesterov"}),
    "muon": None,
}


def _did_you_mean(key: str, candidates: list[str]) -> str:
    close = difflib.get_close_matches(key, candidates, n=1, cutoff=0.6)
    return f" Did you mean '{close[0]}'?" if close else f" Known keys here: {', '.join(sorted(candidates))}."


class OptimizerConfig(_Section):
    """``optimizer``: the optimizer the engine builds when the user passes none.

    Attributes:
        type: as written ("Adam", "AdamW", "SGD", "Muon"), validated case-insensitively.
        params: keyword arguments of the optimizer.
    """

    type: str
    params: dict[str, Any] = Field(default_factory=dict)
    legacy_fusion: bool = False

    NO_EFFECT: ClassVar[frozenset[str]] = frozenset({"legacy_fusion"})

    @field_validator("type")
    @classmethod
    def _known_type(cls, value: str) -> str:
        key = value.lower()
        if key in _SUPPORTED_OPTIMIZERS:
            return value
        if key in _UNSUPPORTED_OPTIMIZERS:
            raise ValueError(
                "recognised DeepSpeed optimizer, not supported by zeroshard. "
                f"Use one of {', '.join(_SUPPORTED_OPTIMIZERS.values())}"
            )
        raise ValueError(
            "unknown optimizer type." + _did_you_mean(value, list(_SUPPORTED_OPTIMIZERS.values()))
        )

    @classmethod
    def check_extra(cls, raw: dict[str, Any], path: str, report: _Report) -> None:
        opt_type = raw.get("type")
        params = raw.get("params")
        if not isinstance(opt_type, str) or not isinstance(params, dict):
            return
        known = _OPTIMIZER_PARAMS.get(opt_type.lower())
        if known is None:
            return
        for key in params:
            if key not in known:
                report.problems.append(
                    f"{path}.params.{key}: unknown parameter of {opt_type}."
                    + _did_you_mean(key, sorted(known))
                )


_SCHEDULER_PARAMS = {
    "WarmupLR": frozenset(
        {"warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type", "last_batch_iteration"}
    ),
    "WarmupDecayLR": frozenset(
        {"warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type", "last_batch_iteration",
         "total_num_steps"}
    ),
    "WarmupCosineLR": frozenset(
        {"total_num_steps", "warmup_min_ratio", "warmup_num_steps", "cos_min_ratio", "warmup_type",
         "last_batch_iteration"}
    ),
}
_UNSUPPORTED_SCHEDULERS = ("LRRangeTest", "OneCycle")


class SchedulerConfig(_Section):
    """``scheduler``: a DeepSpeed learning-rate schedule by name.

    Attributes:
        type: "WarmupLR", "WarmupDecayLR" or "WarmupCosineLR".
        params: the schedule's parameters, with DeepSpeed's names.
    """

    type: str
    params: dict[str, Any] = Field(default_factory=dict)

    @field_validator("type")
    @classmethod
    def _known_type(cls, value: str) -> str:
        if value in _SCHEDULER_PARAMS:
            return value
        if value in _UNSUPPORTED_SCHEDULERS:
            raise ValueError(
                "recognised DeepSpeed scheduler, not supported by zeroshard. "
                f"Use one of {', '.join(_SCHEDULER_PARAMS)}"
            )
        raise ValueError("unknown scheduler type." + _did_you_mean(value, list(_SCHEDULER_PARAMS)))

    @classmethod
    def check_extra(cls, raw: dict[str, Any], path: str, report: _Report) -> None:
        known = _SCHEDULER_PARAMS.get(raw.get("type"))  # type: ignore[arg-type]
        params = raw.get("params")
        if known is None or not isinstance(params, dict):
            return
        for key in params:
            if key not in known:
                report.problems.append(
                    f"{path}.params.{key}: unknown parameter of {raw['type']}."
                    + _did_you_mean(key, sorted(known))
                )


class FP16Config(_Section):
    """``fp16``: fp16 parameters and compute with loss scaling (DeepSpeed defaults).

    ``loss_scale`` 0 means dynamic scaling starting at ``2**initial_scale_power``.
    """

    enabled: bool = False
    loss_scale: float = Field(0.0, ge=0)
    initial_scale_power: int = Field(16, ge=0, le=126)
    loss_scale_window: int = Field(1000, ge=1)
    hysteresis: int = Field(2, ge=1)
    consecutive_hysteresis: bool = False
    min_loss_scale: float = Field(1.0, gt=0)
    fused_mode: bool = True

    NO_EFFECT: ClassVar[frozenset[str]] = frozenset({"fused_mode"})
    NOT_SUPPORTED: ClassVar[dict[str, _Unsupported]] = {
        "auto_cast": _Unsupported(_equals(False), "Inputs are not cast by the engine; cast them yourself."),
        "fp16_master_weights_and_grads": _Unsupported(_equals(False), "Master weights stay fp32 with fp16."),
    }


class BF16Config(_Section):
    """``bf16``: bf16 parameters and compute, fp32 master weights by default.

    ``bf16_master_weights_and_grads`` and ``bf16_optimizer_states`` are DeepSpeed 0.19's
    low-precision options (same key names, same section).
    """

    enabled: bool = False
    check_grad_overflow: bool = True
    bf16_master_weights_and_grads: bool = False
    bf16_optimizer_states: bool = False
    immediate_grad_update: bool = True

    NO_EFFECT: ClassVar[frozenset[str]] = frozenset({"immediate_grad_update"})
    NOT_SUPPORTED: ClassVar[dict[str, _Unsupported]] = {
        "check_overflow": _Unsupported(lambda v: False, "Old spelling: use 'check_grad_overflow'."),
    }

    @property
    def bf16_master_weights_and_gradients(self) -> bool:
        """Same as ``bf16_master_weights_and_grads`` (the JSON key)."""
        return self.bf16_master_weights_and_grads


DEFAULT_LOWER_PRECISION_SAFE_MODULES = (
    "torch.nn.Linear",
    "torch.nn.Conv1d",
    "torch.nn.Conv2d",
    "torch.nn.Conv3d",
)


class TorchAutocastConfig(_Section):
    """``torch_autocast``: fp32 parameters, compute under ``torch.autocast(dtype)``.

    Attributes:
        lower_precision_safe_modules: dotted class names whose parameters are reduced and
            gathered in ``dtype``; None means ``DEFAULT_LOWER_PRECISION_SAFE_MODULES``.
    """

    enabled: bool = False
    dtype: str = "bfloat16"
    lower_precision_safe_modules: list[str] | None = None

    @field_validator("dtype")
    @classmethod
    def _check_dtype(cls, value: str) -> str:
        return _validate_dtype_name(value)  # type: ignore[return-value]


class DataTypesConfig(_Section):
    """``data_types``: ``grad_accum_dtype`` (None lets the precision plan choose, fp32)."""

    grad_accum_dtype: str | None = None

    @field_validator("grad_accum_dtype")
    @classmethod
    def _check_dtype(cls, value: str | None) -> str | None:
        return _validate_dtype_name(value)


class ZeroConfig(_Section):
    """``zero_optimization``: the ZeRO stage and bucket sizes (element counts).

    The bucket sizes bound communication buffers; the other DeepSpeed knobs are accepted and
    change nothing here. ``overlap_comm`` defaults to True at stage 3 and False otherwise, as in
    DeepSpeed.
    """

    stage: int = Field(0, ge=0, le=3)
    reduce_bucket_size: int = Field(500_000_000, ge=1)
    allgather_bucket_size: int = Field(500_000_000, ge=1)
    stage3_prefetch_bucket_size: int = Field(50_000_000, ge=0)
    stage3_param_persistence_threshold: int = Field(100_000, ge=0)
    # Accepted, no effect.
    overlap_comm: bool | None = None
    contiguous_gradients: bool = True
    reduce_scatter: bool = True
    allgather_partitions: bool = True
    use_multi_rank_bucket_allreduce: bool = True
    stage3_max_live_parameters: int = Field(1_000_000_000, ge=0)
    stage3_max_reuse_distance: int = Field(1_000_000_000, ge=0)
    stage3_model_persistence_threshold: int = Field(2**63 - 1, ge=0)
    stage3_module_granularity_threshold: int = 0
    stage3_use_all_reduce_for_fetch_params: bool = False
    stage3_allgather_sequential: bool = False
    stage3_partition_stream_chunk_size: int = 0
    stage3_gather_16bit_weights_on_model_save: bool = False
    stage3_gather_fp16_weights_on_model_save: bool = False
    sub_group_size: int = Field(1_000_000_000, ge=0)
    load_from_fp32_weights: bool = True
    elastic_checkpoint: bool = False
    ignore_unused_parameters: bool = True
    round_robin_gradients: bool = False
    memory_efficient_linear: bool = True
    override_module_apply: bool = True
    pipeline_loading_checkpoint: bool = False
    log_trace_cache_warnings: bool = False
    enable_sanity_checks: bool = False
    save_muon_momentum_buffer_in_memory: bool = False
    cpu_offload_use_pin_memory: bool | None = None

    NO_EFFECT: ClassVar[frozenset[str]] = frozenset(
        {
            "overlap_comm", "contiguous_gradients", "reduce_scatter", "allgather_partitions",
            "use_multi_rank_bucket_allreduce", "stage3_max_live_parameters", "stage3_max_reuse_distance",
            "stage3_model_persistence_threshold", "stage3_module_granularity_threshold",
            "stage3_use_all_reduce_for_fetch_params", "stage3_allgather_sequential",
            "stage3_partition_stream_chunk_size", "stage3_gather_16bit_weights_on_model_save",
            "stage3_gather_fp16_weights_on_model_save", "sub_group_size", "load_from_fp32_weights",
            "elastic_checkpoint", "ignore_unused_parameters", "round_robin_gradients",
            "memory_efficient_linear", "override_module_apply", "pipeline_loading_checkpoint",
            "log_trace_cache_warnings", "enable_sanity_checks", "save_muon_momentum_buffer_in_memory",
            "cpu_offload_use_pin_memory",
        }
    )
    NOT_SUPPORTED: ClassVar[dict[str, _Unsupported]] = {
        "offload_optimizer": _Unsupported(_offload_off, "Offloading is not implemented; remove it."),
        "offload_param": _Unsupported(_offload_off, "Offloading is not implemented; remove it."),
        "cpu_offload": _Unsupported(_equals(False, None), "Offloading is not implemented; remove it."),
        "cpu_offload_param": _Unsupported(_equals(False, None), "Offloading is not implemented; remove it."),
        "zero_hpz_partition_size": _Unsupported(_equals(1), "ZeRO++ hpZ is not implemented; remove it."),
        "zero_quantized_weights": _Unsupported(_equals(False), "ZeRO++ quantization is not implemented."),
        "zero_quantized_nontrainable_weights": _Unsupported(
            _equals(False), "ZeRO++ quantization is not implemented."
        ),
        "zero_quantized_gradients": _Unsupported(_equals(False), "ZeRO++ quantization is not implemented."),
        "zeropp_loco_param": _Unsupported(_empty, "ZeRO++ LoCo is not implemented; remove it."),
        "mics_shard_size": _Unsupported(_equals(-1), "MiCS is not implemented; remove it."),
        "mics_hierarchical_params_gather": _Unsupported(_equals(False), "MiCS is not implemented."),
        "zenflow": _Unsupported(_empty, "ZenFlow is not implemented; remove it."),
        "legacy_stage1": _Unsupported(_equals(False), "Remove it."),
        "leaf_module": _Unsupported(_empty, "Use zeroshard.unit_module_classes to choose units."),
    }

    @property
    def overlap_comm_resolved(self) -> bool:
        """DeepSpeed's dynamic default: on at stage 3, off otherwise."""
        return self.stage == 3 if self.overlap_comm is None else self.overlap_comm


class ZeroshardExtras(_Section):
    """``zeroshard``: our own section (not DeepSpeed's).

    Attributes:
        unit_module_classes: dotted or bare class names whose instances become units; None =
            the automatic rule of DESIGN section 3.
        unit_min_params: units smaller than this merge into the root unit.
        shard_group_size: hybrid sharding: shard over groups of this many consecutive ranks
            and replicate across them (zeroshard/layout.py); None = shard over every rank.
    """

    unit_module_classes: list[str] | None = None
    unit_min_params: int = Field(0, ge=0)
    shard_group_size: int | None = Field(None, ge=1)


class ZeroshardConfig(_Section):
    """A validated, resolved zeroshard config. Build it with ``load_config``.

    The batch-size triangle is resolved for the world size given to ``load_config`` (so the
    three batch fields are ints afterwards). ``defaults_applied``, ``no_effect_keys``,
    ``derived_keys``, ``raw`` and ``world_size`` describe how it was built.
    """

    train_batch_size: int | None = Field(None, ge=1)
    train_micro_batch_size_per_gpu: int | None = Field(None, ge=1)
    gradient_accumulation_steps: int | None = Field(None, ge=1)
    optimizer: OptimizerConfig | None = None
    scheduler: SchedulerConfig | None = None
    gradient_clipping: float = Field(1.0, ge=0)
    fp16: FP16Config = Field(default_factory=FP16Config)
    bf16: BF16Config = Field(default_factory=BF16Config)
    torch_autocast: TorchAutocastConfig = Field(default_factory=TorchAutocastConfig)
    data_types: DataTypesConfig = Field(default_factory=DataTypesConfig)
    communication_data_type: str | None = None
    zero_optimization: ZeroConfig = Field(default_factory=ZeroConfig)
    steps_per_print: int = Field(10, ge=1)
    seed: int | None = None
    dataloader_drop_last: bool = False
    zeroshard: ZeroshardExtras = Field(default_factory=ZeroshardExtras)
    # Accepted, no effect: logging, monitoring and permission knobs.
    wall_clock_breakdown: bool = False
    memory_breakdown: bool = False
    dump_state: bool = False
    zero_allow_untested_optimizer: bool = False
    zero_force_ds_cpu_optimizer: bool = True
    vocabulary_size: int | None = None
    flops_profiler: dict[str, Any] | None = None
    tensorboard: dict[str, Any] | None = None
    wandb: dict[str, Any] | None = None
    csv_monitor: dict[str, Any] | None = None
    comet: dict[str, Any] | None = None
    comms_logger: dict[str, Any] | None = None
    checkpoint: dict[str, Any] | None = None
    aio: dict[str, Any] | None = None
    timers: dict[str, Any] | None = None
    seq_parallel_communication_data_type: str | None = None
    use_data_before_expert_parallelism: bool = False

    @field_validator("communication_data_type")
    @classmethod
    def _check_dtype(cls, value: str | None) -> str | None:
        return _validate_dtype_name(value)

    NO_EFFECT: ClassVar[frozenset[str]] = frozenset(
        {
            "wall_clock_breakdown", "memory_breakdown", "dump_state", "zero_allow_untested_optimizer",
            "zero_force_ds_cpu_optimizer", "vocabulary_size", "flops_profiler", "tensorboard", "wandb",
            "csv_monitor", "comet", "comms_logger", "checkpoint", "aio", "timers",
            "seq_parallel_communication_data_type", "use_data_before_expert_parallelism",
        }
    )
    UNLISTED_DEFAULTS: ClassVar[frozenset[str]] = frozenset(
        {"optimizer", "scheduler", "seed", "train_batch_size", "train_micro_batch_size_per_gpu",
         "gradient_accumulation_steps"}
    )
    NOT_SUPPORTED: ClassVar[dict[str, _Unsupported]] = {
        "bfloat16": _Unsupported(lambda v: False, "Old spelling: use the 'bf16' section."),
        "amp": _Unsupported(_disabled_section, "Use 'bf16', 'fp16' or 'torch_autocast'."),
        "activation_checkpointing": _Unsupported(_empty, "Use torch.utils.checkpoint in your model."),
        "sparse_attention": _Unsupported(_empty, "Remove it."),
        "pipeline": _Unsupported(_empty, "zeroshard is data-parallel only; remove it."),
        "compression_training": _Unsupported(_empty, "Remove it."),
        "curriculum_learning": _Unsupported(_disabled_section, "Remove it."),
        "data_efficiency": _Unsupported(_disabled_section, "Remove it."),
        "elasticity": _Unsupported(_disabled_section, "Remove it."),
        "autotuning": _Unsupported(_disabled_section, "Remove it."),
        "nebula": _Unsupported(_disabled_section, "Remove it."),
        "hybrid_engine": _Unsupported(_disabled_section, "Remove it."),
        "quantize_training": _Unsupported(_disabled_section, "Remove it."),
        "eigenvalue": _Unsupported(_disabled_section, "Remove it."),
        "progressive_layer_drop": _Unsupported(_disabled_section, "Remove it."),
        "compile": _Unsupported(_disabled_section, "Call torch.compile on your model yourself."),
        "weight_quantization": _Unsupported(_empty, "Remove it."),
        "tensor_parallel": _Unsupported(
            lambda v: _empty(v) or (isinstance(v, dict) and v.get("autotp_size", 1) in (0, 1)),
            "zeroshard is data-parallel only; remove it.",
        ),
        "sequence_parallel_size": _Unsupported(_equals(1), "zeroshard is data-parallel only."),
        "sparse_gradients": _Unsupported(_equals(False), "Gradients are dense; remove it."),
        "prescale_gradients": _Unsupported(
            _equals(False), "Gradients are averaged after the reduction; remove it."
        ),
        "gradient_predivide_factor": _Unsupported(_equals(1.0), "Remove it (the factor is always 1)."),
        "disable_allgather": _Unsupported(_equals(False), "Remove it."),
        "graph_harvesting": _Unsupported(_equals(False), "Remove it."),
        "zero_optimization_stage": _Unsupported(lambda v: False, "Use zero_optimization.stage."),
    }

    _defaults_applied: list[str] = PrivateAttr(default_factory=list)
    _derived_keys: list[str] = PrivateAttr(default_factory=list)
    _no_effect_keys: list[str] = PrivateAttr(default_factory=list)
    _raw: dict[str, Any] = PrivateAttr(default_factory=dict)
    _world_size: int = PrivateAttr(default=1)

    @property
    def defaults_applied(self) -> list[str]:
        """JSON paths that took a default (tuning knobs with no effect are not listed)."""
        return self._defaults_applied

    @property
    def derived_keys(self) -> list[str]:
        """Batch-triangle keys computed from the other two (and the world size)."""
        return self._derived_keys

    @property
    def no_effect_keys(self) -> list[str]:
        """JSON paths of accepted-no-effect keys the user set."""
        return self._no_effect_keys

    @property
    def raw(self) -> dict[str, Any]:
        """The config as the user gave it."""
        return self._raw

    @property
    def world_size(self) -> int:
        """The world size the batch triangle was resolved for."""
        return self._world_size


# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------


class _Report:
    def __init__(self) -> None:
        self.problems: list[str] = []
        self.no_effect: list[str] = []
        self.no_effect_changed: list[str] = []


def _join(path: str, key: str | int) -> str:
    return f"{path}.{key}" if path else str(key)


def _show(value: Any) -> str:
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _is_auto(value: Any) -> bool:
    return isinstance(value, str) and value.strip().lower() == "auto"


def _find_autos(value: Any, path: str, report: _Report) -> bool:
    """Report every "auto" inside ``value``; True if any was found."""
    found = False
    if _is_auto(value):
        report.problems.append(
            f'{path}="auto": "auto" is a placeholder that the Hugging Face integration fills in; '
            "zeroshard does not. Resolve it to a concrete value before initialize."
        )
        return True
    if isinstance(value, dict):
        for k, v in value.items():
            found |= _find_autos(v, _join(path, k), report)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            found |= _find_autos(v, _join(path, i), report)
    return found


def _section_class(annotation: Any) -> type[_Section] | None:
    """The section model inside ``annotation`` (unwrapping ``X | None``), if any."""
    candidates = typing.get_args(annotation) or (annotation,)
    for candidate in candidates:
        if isinstance(candidate, type) and issubclass(candidate, _Section):
            return candidate
    return None


def _asks_for_something(value: Any, default: Any) -> bool:
    """Whether a no-effect knob is set to something other than "leave it as it is"."""
    if value == default:
        return False
    if default is None and isinstance(value, bool):
        return False  # e.g. overlap_comm, whose DeepSpeed default depends on the stage
    if isinstance(value, dict) and not value.get("enabled", True):
        return False
    return True


def _walk(section: type[_Section], raw: dict[str, Any], path: str, report: _Report) -> dict[str, Any]:
    """Classify every key of ``raw``; return the part pydantic should validate."""
    cleaned: dict[str, Any] = {}
    for key, value in raw.items():
        key_path = _join(path, key)
        if not isinstance(key, str):
            report.problems.append(f"{key_path}: keys must be strings.")
            continue
        if _find_autos(value, key_path, report):
            continue
        if key in section.model_fields:
            sub = _section_class(section.model_fields[key].annotation)
            if sub is not None and isinstance(value, dict):
                cleaned[key] = _walk(sub, value, key_path, report)
                sub.check_extra(value, key_path, report)
            else:
                cleaned[key] = value
            if key in section.NO_EFFECT:
                report.no_effect.append(key_path)
                if _asks_for_something(value, section.model_fields[key].get_default(call_default_factory=True)):
                    report.no_effect_changed.append(key_path)
        elif key in section.NOT_SUPPORTED:
            unsupported = section.NOT_SUPPORTED[key]
            if unsupported.is_inert(value):
                report.no_effect.append(key_path)
            else:
                report.problems.append(
                    f"{key_path}={_show(value)}: recognised DeepSpeed key, not supported by zeroshard. "
                    f"{unsupported.hint}"
                )
        else:
            report.problems.append(f"{key_path}: unknown key." + _did_you_mean(key, section.json_keys()))
    return cleaned


def _pydantic_problems(error: ValidationError) -> list[str]:
    problems = []
    for item in error.errors():
        path = ".".join(str(p) for p in item["loc"])
        message = str(item["msg"]).removeprefix("Value error, ").rstrip(".")
        if item["type"] == "missing":
            problems.append(f"{path}: required key is missing.")
        else:
            end = "" if message.endswith(("?", ".")) else "."
            problems.append(f"{path}={_show(item.get('input'))}: {message}{end}")
    return problems


def _collect_defaults(model: _Section, raw: dict[str, Any], path: str, out: list[str]) -> None:
    for name in type(model).model_fields:
        if name in type(model).NO_EFFECT or name in type(model).UNLISTED_DEFAULTS:
            continue
        value = getattr(model, name)
        field_path = _join(path, name)
        if isinstance(value, _Section):
            sub_raw = raw.get(name)
            if not isinstance(sub_raw, dict):
                sub_raw = {}
            if "enabled" in type(value).model_fields and not value.enabled:
                # A switched-off section: only the switch itself is a default worth listing.
                if "enabled" not in sub_raw:
                    out.append(_join(field_path, "enabled"))
                continue
            _collect_defaults(value, sub_raw, field_path, out)
        elif name not in raw:
            out.append(field_path)


_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
_warned_no_effect: set[str] = set()


def _resolve_batch_triangle(cfg: ZeroshardConfig, world_size: int) -> list[str]:
    """Apply DeepSpeed's rule: any two of the three batch keys give the third.

    Returns the problems found (empty if consistent); fills the three fields in ``cfg``.
    """
    train, micro, accum = cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps
    derived: list[str] = []
    defaults: list[str] = []
    if train is not None and micro is not None and accum is not None:
        if train != micro * accum * world_size:
            return [
                f"train_batch_size={train} != train_micro_batch_size_per_gpu ({micro}) * "
                f"gradient_accumulation_steps ({accum}) * world_size ({world_size}) = "
                f"{micro * accum * world_size}. Fix one of them, or drop one key and it will be derived."
            ]
    elif train is not None and micro is not None:
        if train % (micro * world_size):
            return [
                f"train_batch_size={train} is not divisible by train_micro_batch_size_per_gpu ({micro}) "
                f"* world_size ({world_size}) = {micro * world_size}, so gradient_accumulation_steps "
                "cannot be derived. Fix one of them, or give gradient_accumulation_steps instead."
            ]
        accum = train // (micro * world_size)
        derived.append("gradient_accumulation_steps")
    elif train is not None and accum is not None:
        if train % (accum * world_size):
            return [
                f"train_batch_size={train} is not divisible by gradient_accumulation_steps ({accum}) "
                f"* world_size ({world_size}) = {accum * world_size}, so train_micro_batch_size_per_gpu "
                "cannot be derived. Fix one of them, or give train_micro_batch_size_per_gpu instead."
            ]
        micro = train // (accum * world_size)
        derived.append("train_micro_batch_size_per_gpu")
    elif train is not None:
        accum = 1
        defaults.append("gradient_accumulation_steps")
        if train % world_size:
            return [
                f"train_batch_size={train} is not divisible by world_size ({world_size}), so "
                "train_micro_batch_size_per_gpu cannot be derived. Make it a multiple of the world size."
            ]
        micro = train // world_size
        derived.append("train_micro_batch_size_per_gpu")
    else:
        if micro is None:
            micro = 1
            defaults.append("train_micro_batch_size_per_gpu")
        if accum is None:
            accum = 1
            defaults.append("gradient_accumulation_steps")
        train = micro * accum * world_size
        derived.append("train_batch_size")
    cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps = (
        train, micro, accum,
    )
    cfg._derived_keys.extend(derived)
    cfg._defaults_applied[:0] = defaults
    return []


def _read_raw(raw: dict | str | os.PathLike) -> dict[str, Any]:
    if isinstance(raw, dict):
        return raw
    if isinstance(raw, (str, os.PathLike)):
        path = Path(raw)
        try:
            text = path.read_text()
        except OSError as exc:
            raise ConfigError(f"config file {str(path)!r} cannot be read: {exc.strerror or exc}.") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(
                f"config file {str(path)!r} is not valid JSON: {exc.msg} at line {exc.lineno}, "
                f"column {exc.colno}."
            ) from None
        if not isinstance(data, dict):
            raise ConfigError(f"config file {str(path)!r} must hold a JSON object, not {type(data).__name__}.")
        return data
    raise ConfigError(f"config must be a dict or a path to a JSON file, not {type(raw).__name__}.")


def load_config(raw: dict | str | os.PathLike, world_size: int = 1) -> ZeroshardConfig:
    """Validate a DeepSpeed-style config and resolve it for ``world_size`` ranks.

    Args:
        raw: the config as a dict, or the path of a JSON file holding it.
        world_size: data-parallel world size, used to resolve the batch-size triangle.

    Returns:
        The validated config, with defaults filled in and the batch triangle resolved.

    Raises:
        ConfigError: listing every problem, each naming its JSON path.
    """
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ConfigError(f"world_size={world_size!r}: must be a positive integer.")
    data = _read_raw(raw)
    report = _Report()
    cleaned = _walk(ZeroshardConfig, data, "", report)
    problems = list(report.problems)
    try:
        cfg = ZeroshardConfig.model_validate(cleaned)
    except ValidationError as exc:
        problems.extend(_pydantic_problems(exc))
        cfg = None
    if cfg is not None and not problems:
        cfg._raw = copy.deepcopy(data)
        cfg._world_size = world_size
        cfg._no_effect_keys = list(report.no_effect)
        _collect_defaults(cfg, cleaned, "", cfg._defaults_applied)
        if cfg.zero_optimization.overlap_comm is None:
            cfg.zero_optimization.overlap_comm = cfg.zero_optimization.overlap_comm_resolved
        problems.extend(_resolve_batch_triangle(cfg, world_size))
    if problems:
        raise ConfigError(problems)
    assert cfg is not None
    new_warnings = [k for k in report.no_effect_changed if k not in _warned_no_effect]
    if new_warnings:
        _warned_no_effect.update(new_warnings)
        warnings.warn(
            "zeroshard accepts these DeepSpeed keys but they change nothing here: "
            + ", ".join(new_warnings),
            UserWarning,
            stacklevel=2,
        )
    return cfg
