"""The sections of a config (zeroshard.config.schema): one pydantic model per DeepSpeed section.

Each section knows its keys in the three classes of docs/design.md section 1: its fields (supported;
those in ``NO_EFFECT`` accepted with no effect), ``NOT_SUPPORTED`` (recognised, refused unless
inert) and ``ALIASES`` (DeepSpeed's other spellings). Types are strict: a JSON string is never
read as a number or a boolean. ``zeroshard.config.schema`` walks a raw config through these models.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator

from zeroshard.config.base import (  # noqa: F401 - re-exported: schema.py and expert_parallel.py import them here
    _AUTO_IS_A_VALUE,
    _DTYPE_ALIASES,
    JsonInt,
    _disabled_section,
    _empty,
    _equals,
    _find_autos,
    _integral_float_to_int,
    _is_auto,
    _join,
    _Report,
    _Section,
    _show,
    _Unsupported,
    _validate_dtype_name,
    canonical_dtype_name,
)
from zeroshard.config.choices import SCHEDULER_TYPES
from zeroshard.config.optimizer_params import NO_EFFECT as OPTIMIZER_NO_EFFECT
from zeroshard.config.optimizer_params import OPTIMIZER_PARAMS
from zeroshard.config.optimizer_params import render_problems as optimizer_param_problems
from zeroshard.config.optimizers import OPTIMIZERS, UNSUPPORTED_OPTIMIZERS
from zeroshard.config.suggest import did_you_mean

# ---------------------------------------------------------------------------------------------
# Sections
# ---------------------------------------------------------------------------------------------

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
        supported = [kind.name for kind in OPTIMIZERS.values()]
        if key in OPTIMIZERS:
            return value
        if key in UNSUPPORTED_OPTIMIZERS:
            raise ValueError(
                f"recognised DeepSpeed optimizer, not supported by zeroshard. Use one of {', '.join(supported)}"
            )
        raise ValueError("unknown optimizer type." + did_you_mean(value, supported))

    @classmethod
    def check_extra(cls, raw: dict[str, Any], path: str, report: _Report) -> None:
        # Adam/AdamW/SGD parameters by the rules build_optimizer applies (optimizer_params.py);
        # Muon's are checked by resolve_config (they need zeroshard/optim/muon/, which needs torch).
        opt_type = raw.get("type")
        params = raw.get("params")
        if not isinstance(opt_type, str) or not isinstance(params, dict):
            return
        if opt_type.lower() not in OPTIMIZER_PARAMS:
            return
        report.problems.extend(optimizer_param_problems(opt_type, params))
        report.no_effect.extend(f"{path}.params.{k}" for k in params if k in OPTIMIZER_NO_EFFECT)


_UNSUPPORTED_SCHEDULERS = ("LRRangeTest",)


class SchedulerConfig(_Section):
    """``scheduler``: a DeepSpeed learning-rate schedule by name.

    Attributes:
        type: "WarmupLR", "WarmupDecayLR", "WarmupCosineLR" or "OneCycle".
        params: the schedule's parameters, with DeepSpeed's names.
    """

    type: str
    params: dict[str, Any] = Field(default_factory=dict)

    @field_validator("type")
    @classmethod
    def _known_type(cls, value: str) -> str:
        if value in SCHEDULER_TYPES:
            return value
        if value in _UNSUPPORTED_SCHEDULERS:
            raise ValueError(
                "recognised DeepSpeed scheduler, not supported by zeroshard. "
                f"Use one of {', '.join(SCHEDULER_TYPES)}"
            )
        raise ValueError("unknown scheduler type." + did_you_mean(value, SCHEDULER_TYPES))
    # The schedules' parameters are checked by their own rules (zeroshard.optim.schedulers) in
    # the resolve pass (zeroshard/resolve/rules.py).


class FP16Config(_Section):
    """``fp16``: fp16 parameters and compute with loss scaling (DeepSpeed defaults).

    ``loss_scale`` 0 means dynamic scaling starting at ``2**initial_scale_power``.
    """

    enabled: bool = False
    loss_scale: float = Field(0.0, ge=0)
    # The dynamic-scaling knobs' ranges are checked only where dynamic scaling is in force
    # (check_extra): DeepSpeed 0.19 accepts any value beside a static scale or with fp16 off.
    initial_scale_power: JsonInt = 16
    loss_scale_window: JsonInt = 1000
    hysteresis: JsonInt = 2
    consecutive_hysteresis: bool = False
    min_loss_scale: float = 1.0
    fused_mode: bool = True

    NO_EFFECT: ClassVar[frozenset[str]] = frozenset({"fused_mode"})
    # Dynamic-scaling knobs: with a static scale or fp16 off they change nothing (DeepSpeed
    # accepts them there too); the config lists them as "accepted, no effect" in that case.
    DYNAMIC_ONLY: ClassVar[tuple[str, ...]] = (
        "initial_scale_power", "loss_scale_window", "hysteresis", "consecutive_hysteresis", "min_loss_scale",
    )
    NOT_SUPPORTED: ClassVar[dict[str, _Unsupported]] = {
        "auto_cast": _Unsupported(_equals(False), "Inputs are not cast by the engine; cast them yourself."),
        "fp16_master_weights_and_grads": _Unsupported(_equals(False), "Master weights stay fp32 with fp16."),
    }
    # (key, lowest, highest, how the bound reads): the ranges the dynamic scaler needs.
    _DYNAMIC_RANGES: ClassVar[tuple[tuple[str, float, float, str], ...]] = (
        ("initial_scale_power", 0, 126, "between 0 and 126 (2**power must be a finite float)"),
        ("loss_scale_window", 1, math.inf, "at least 1"),
        ("hysteresis", 1, math.inf, "at least 1"),
        ("min_loss_scale", math.nextafter(0.0, 1.0), math.inf, "greater than 0"),
    )

    @field_validator("loss_scale", "min_loss_scale")
    @classmethod
    def _finite(cls, value: float) -> float:
        # DeepSpeed 0.19 refuses a non-finite scale or floor whatever the mode.
        if not math.isfinite(value):
            raise ValueError("must be a finite number. Write a positive number (loss_scale: 0 is dynamic scaling)")
        return value

    @classmethod
    def check_extra(cls, raw: dict[str, Any], path: str, report: _Report) -> None:
        scale = raw.get("loss_scale", 0)
        if raw.get("enabled") is not True or scale != 0 or isinstance(scale, bool):
            return  # a static scale or fp16 off: the knobs are accepted, no effect (schema.py)
        for key, low, high, bound in cls._DYNAMIC_RANGES:
            value = raw.get(key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                continue  # a type error, reported by pydantic
            if not low <= value <= high:
                report.problems.append(
                    f"{_join(path, key)}={_show(value)}: must be {bound} with dynamic loss scaling "
                    f"(fp16 enabled, loss_scale 0). Change it, or set a static fp16.loss_scale."
                )


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
    """``data_types``: ``grad_accum_dtype`` (None lets the precision plan choose, fp32),
    ``buffer_dtype`` (None: floating buffers keep their own dtype in every mode) and
    ``param_dtype`` (None, or the dtype the enabled mode gives parameters: fp16, bf16, else fp32)."""

    grad_accum_dtype: str | None = None
    buffer_dtype: str | None = None
    # DeepSpeed 0.19: a restatement of the mode's parameter dtype, checked by resolve_config.
    param_dtype: str | None = None

    @field_validator("grad_accum_dtype", "buffer_dtype", "param_dtype")
    @classmethod
    def _check_dtype(cls, value: str | None) -> str | None:
        return _validate_dtype_name(value)


# ZeRO-Offload (zero_optimization.offload_optimizer / offload_param); the rules across keys
# are in zeroshard/config/offload.py.
_NVME_REFUSAL = (
    'offloading to NVMe (ZeRO-Infinity) is not supported by zeroshard. Use "cpu" (host memory), or "none"'
)


def _device(value: Any) -> Any:
    if isinstance(value, str):
        lowered = value.lower()
        if lowered == "nvme":
            raise ValueError(_NVME_REFUSAL)
        if lowered not in ("cpu", "none"):
            raise ValueError('must be "cpu" or "none". Use "cpu" to keep this state in host memory')
        return lowered
    return value


class OffloadOptimizerConfig(_Section):
    """``zero_optimization.offload_optimizer``: master weights and optimizer state on the host."""

    device: str = "none"
    pin_memory: bool = False
    ratio: float = Field(1.0, gt=0.0, le=1.0)
    nvme_path: str | None = None
    buffer_count: JsonInt = Field(4, ge=0)
    pipeline_read: bool = False
    pipeline_write: bool = False
    fast_init: bool = False

    NO_EFFECT: ClassVar[frozenset[str]] = frozenset(
        {"nvme_path", "buffer_count", "pipeline_read", "pipeline_write", "fast_init"}
    )
    UNLISTED_DEFAULTS: ClassVar[frozenset[str]] = frozenset({"ratio"})

    @field_validator("device", mode="before")
    @classmethod
    def _check_device(cls, value: Any) -> Any:
        return _device(value)

    @field_validator("ratio", mode="before")
    @classmethod
    def _check_ratio(cls, value: Any) -> Any:
        if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < 1:
            raise ValueError(
                "a partial offload (part of the optimizer step on the device, Offload++) is not "
                "supported by zeroshard. Use 1.0 (the whole step on the host)"
            )
        return float(value) if isinstance(value, int) and not isinstance(value, bool) else value

    @property
    def enabled(self) -> bool:
        return self.device == "cpu"


class OffloadParamConfig(_Section):
    """``zero_optimization.offload_param``: stage 3's parameter shards on the host."""

    device: str = "none"
    pin_memory: bool = False
    nvme_path: str | None = None
    buffer_count: JsonInt = Field(5, ge=0)
    buffer_size: JsonInt = Field(100_000_000, ge=0)
    max_in_cpu: JsonInt = Field(1_000_000_000, ge=0)

    NO_EFFECT: ClassVar[frozenset[str]] = frozenset({"nvme_path", "buffer_count", "buffer_size", "max_in_cpu"})

    @field_validator("device", mode="before")
    @classmethod
    def _check_device(cls, value: Any) -> Any:
        return _device(value)

    @property
    def enabled(self) -> bool:
        return self.device == "cpu"



# DeepSpeed 0.19's default leaf classes: Hugging Face MoE blocks whose experts run data-dependently.
DEFAULT_LEAF_MODULE_CLASSES = (
    "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
    "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
    "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock",
)


class LeafModuleConfig(_Section):
    """``zero_optimization.leaf_module``: modules marked as stage-3 leaves at initialize
    (zeroshard/zero/leaf_modules.py): by class (bare or dotted name), by module name as
    ``named_modules`` gives it, or by the end of that name."""

    classes: list[str] = Field(default_factory=lambda: list(DEFAULT_LEAF_MODULE_CLASSES))
    names: list[str] = Field(default_factory=list)
    name_suffixes: list[str] = Field(default_factory=list)


class ZeroConfig(_Section):
    """``zero_optimization``: the ZeRO stage and bucket sizes (element counts).

    The bucket sizes bound communication buffers; the other DeepSpeed knobs are accepted and
    change nothing here. ``overlap_comm`` defaults to True at stage 3 and False otherwise, as in
    DeepSpeed.
    """

    stage: JsonInt = Field(0, ge=0, le=3)
    reduce_bucket_size: JsonInt = Field(500_000_000, ge=1)
    allgather_bucket_size: JsonInt = Field(500_000_000, ge=1)
    stage3_prefetch_bucket_size: JsonInt = Field(50_000_000, ge=0)
    stage3_param_persistence_threshold: JsonInt = Field(100_000, ge=0)
    # Stage 3's memory caps (zeroshard/sharding/schedule.py). The reuse distance defaults to 0
    # (free every unit after each use, as FSDP2 does) where DeepSpeed's is 1e9: a written value
    # gets DeepSpeed's behaviour (docs/migrating-from-deepspeed.md).
    stage3_max_live_parameters: JsonInt = Field(1_000_000_000, ge=0)
    stage3_max_reuse_distance: JsonInt = Field(0, ge=0)
    # Accepted, no effect.
    overlap_comm: bool | None = None
    contiguous_gradients: bool = True
    reduce_scatter: bool = True
    allgather_partitions: bool = True
    use_multi_rank_bucket_allreduce: bool = True
    stage3_model_persistence_threshold: JsonInt = Field(2**63 - 1, ge=0)
    stage3_module_granularity_threshold: JsonInt = 0
    stage3_use_all_reduce_for_fetch_params: bool = False
    stage3_allgather_sequential: bool = False
    stage3_partition_stream_chunk_size: JsonInt = 0
    stage3_gather_16bit_weights_on_model_save: bool = False
    stage3_gather_fp16_weights_on_model_save: bool = False
    sub_group_size: JsonInt = Field(1_000_000_000, ge=0)
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
    # ZeRO-Offload, and DeepSpeed's legacy booleans for it (cpu_offload = offload_optimizer cpu).
    offload_optimizer: OffloadOptimizerConfig | None = None
    offload_param: OffloadParamConfig | None = None
    cpu_offload: bool | None = None
    cpu_offload_param: bool | None = None
    leaf_module: LeafModuleConfig = Field(default_factory=LeafModuleConfig)

    NO_EFFECT: ClassVar[frozenset[str]] = frozenset(
        {
            "overlap_comm", "contiguous_gradients", "reduce_scatter", "allgather_partitions",
            "use_multi_rank_bucket_allreduce", "stage3_model_persistence_threshold",
            "stage3_module_granularity_threshold",
            "stage3_use_all_reduce_for_fetch_params", "stage3_allgather_sequential",
            "stage3_partition_stream_chunk_size", "sub_group_size", "load_from_fp32_weights",
            "elastic_checkpoint", "ignore_unused_parameters", "round_robin_gradients",
            "memory_efficient_linear", "override_module_apply", "pipeline_loading_checkpoint",
            "log_trace_cache_warnings", "enable_sanity_checks", "save_muon_momentum_buffer_in_memory",
            "cpu_offload_use_pin_memory",
        }
    )
    # Defaults not worth listing: the leaf-module section (off), the offload switches (off), and
    # the save-time gather flags, which no training result depends on (Hugging Face reads them
    # through `engine.zero_gather_16bit_weights_on_model_save()`).
    UNLISTED_DEFAULTS: ClassVar[frozenset[str]] = frozenset(
        {"leaf_module", "cpu_offload", "cpu_offload_param", "stage3_gather_16bit_weights_on_model_save",
         "stage3_gather_fp16_weights_on_model_save"}
    )
    # DeepSpeed's names without the stage3_ prefix (its pydantic aliases).
    ALIASES: ClassVar[dict[str, str]] = {
        "param_persistence_threshold": "stage3_param_persistence_threshold",
        "prefetch_bucket_size": "stage3_prefetch_bucket_size",
        "max_live_parameters": "stage3_max_live_parameters",
        "max_reuse_distance": "stage3_max_reuse_distance",
        "model_persistence_threshold": "stage3_model_persistence_threshold",
        "module_granularity_threshold": "stage3_module_granularity_threshold",
        "use_all_reduce_for_fetch_params": "stage3_use_all_reduce_for_fetch_params",
        "gather_16bit_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
    }
    NOT_SUPPORTED: ClassVar[dict[str, _Unsupported]] = {
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
    }

    @property
    def optimizer_offload(self) -> bool:
        """Master weights and optimizer state on the host (offload_optimizer, or cpu_offload)."""
        return bool(self.cpu_offload) or (self.offload_optimizer is not None and self.offload_optimizer.enabled)

    @property
    def param_offload(self) -> bool:
        """Stage 3's parameter shards on the host (offload_param, or cpu_offload_param)."""
        return bool(self.cpu_offload_param) or (self.offload_param is not None and self.offload_param.enabled)

    @property
    def offload_pin_memory(self) -> bool:
        """Pin the host buffers (either section's pin_memory)."""
        return any(s is not None and s.enabled and s.pin_memory for s in (self.offload_optimizer, self.offload_param))

    @property
    def overlap_comm_resolved(self) -> bool:
        """DeepSpeed's dynamic default: on at stage 3, off otherwise."""
        return self.stage == 3 if self.overlap_comm is None else self.overlap_comm


class CheckpointWriterConfig(_Section):
    """``checkpoint.writer``: DeepSpeed's checkpoint writer (deepspeed/runtime/model_checkpointing).

    Attributes:
        decoupled: asynchronous saves: ``save_checkpoint`` returns once the state is copied to
            host memory and a background thread writes the files (docs/checkpoints.md,
            "Asynchronous saves"; zeroshard/checkpoint/async_save.py).
        type: DeepSpeed's writer implementation ("python" or "fast", any case); zeroshard
            writes its own format either way. "mock" (write nothing) is refused.
    """

    type: str = "fast"
    decoupled: bool = False
    io_buffer_size: JsonInt = Field(64 * 1024**2, ge=1)
    io_buffer_double: bool = True
    show_statistics: bool = False
    data_parallel: str | None = None
    io_multiplier: JsonInt = Field(1, ge=1)

    NO_EFFECT: ClassVar[frozenset[str]] = frozenset(
        {"type", "io_buffer_size", "io_buffer_double", "show_statistics", "data_parallel", "io_multiplier"}
    )

    @field_validator("type")
    @classmethod
    def _known_type(cls, value: str) -> str:
        if value.lower() == "mock":
            raise ValueError("the mock writer writes nothing; zeroshard always writes the checkpoint. Remove it")
        if value.lower() not in ("python", "fast"):
            raise ValueError("must be one of mock, python, fast (DeepSpeed's writer types)")
        return value


class CheckpointConfig(_Section):
    """``checkpoint``: DeepSpeed's checkpoint options.

    Attributes:
        tag_validation: what ``save_checkpoint`` does when ranks pass different tags:
            "Ignore", "Warn" (DeepSpeed's default) or "Fail"; any capitalisation is accepted
            and stored in this one.
        writer: DeepSpeed's writer section; its ``decoupled`` turns on asynchronous saves.
    """

    tag_validation: Literal["Ignore", "Warn", "Fail"] = "Warn"
    # DeepSpeed's switch to load ds_to_universal output: load_checkpoint with no tag then reads the
    # tag `latest_universal` names (universal checkpoints are recognised by their layout either way).
    load_universal: bool = False
    use_node_local_storage: bool = False
    parallel_write: dict[str, Any] | None = None
    writer: CheckpointWriterConfig | None = None

    NO_EFFECT: ClassVar[frozenset[str]] = frozenset({"use_node_local_storage", "parallel_write"})

    @field_validator("tag_validation", mode="before")
    @classmethod
    def _any_case(cls, value: Any) -> Any:
        if isinstance(value, str):
            for mode in ("Ignore", "Warn", "Fail"):
                if value.lower() == mode.lower():
                    return mode
        return value
