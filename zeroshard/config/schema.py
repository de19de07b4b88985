"""The DeepSpeed JSON config subset zeroshard understands, as pydantic models.

The sections' models are in zeroshard/config/sections.py, reading a file (JSON, HJSON) in
zeroshard/config/file.py; this module holds the whole config's model and the per-key pass
(``_check_config``). ``zeroshard.resolve.rules.resolve_config`` runs it, adds the rules across
sections and the components' own rules, and is the one way to get a config object (what
``initialize`` and ``zeroshard explain`` use). This module imports nothing of zeroshard outside
zeroshard/config (tests/unit/config/test_config_leaf.py).

Every key a user can write falls in exactly one of three classes (docs/design.md section 1):

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
``<json.path>=<value>: <rule>. <fix>``. Types are strict: ``"2"`` is not an integer, ``"yes"``
not a boolean (an integral float such as ``5e8`` is an integer, as JSON writes it). The
resolved config is frozen.
"""

from __future__ import annotations

import copy
import os
import typing
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, ClassVar

from pydantic import Field, PrivateAttr, ValidationError, field_validator

from zeroshard.config.batch import BATCH_KEYS, data_parallel_size, resolve_batch_triangle
from zeroshard.config.choices import DEFAULT_COLLECTIVE_TIMEOUT_S
from zeroshard.config.compile import CompileConfig
from zeroshard.config.error import ConfigError, DeepSpeedConfigError
from zeroshard.config.expert_parallel import ExpertParallelConfig
from zeroshard.config.file import check_depth, read_config_file
from zeroshard.config.fp8 import Fp8Config
from zeroshard.config.integration_values import StepsPerPrint, dotted_top_level_key
from zeroshard.config.monitor import COMET_REFUSAL, CsvMonitorConfig, TensorBoardConfig, WandbConfig
from zeroshard.config.preemption import PreemptionConfig
from zeroshard.config.sections import (
    DEFAULT_LOWER_PRECISION_SAFE_MODULES,
    BF16Config,
    CheckpointConfig,
    DataTypesConfig,
    FP16Config,
    JsonInt,
    OptimizerConfig,
    SchedulerConfig,
    TorchAutocastConfig,
    ZeroConfig,
    _disabled_section,
    _empty,
    _equals,
    _find_autos,
    _join,
    _Report,
    _Section,
    _show,
    _Unsupported,
    _validate_dtype_name,
    canonical_dtype_name,
)
from zeroshard.config.suggest import did_you_mean
from zeroshard.config.tensor_parallel import TensorParallelConfig

__all__ = [
    "BF16Config",
    "CheckpointConfig",
    "ConfigError",
    "DeepSpeedConfigError",
    "DEFAULT_LOWER_PRECISION_SAFE_MODULES",
    "DataTypesConfig",
    "FP16Config",
    "OptimizerConfig",
    "SchedulerConfig",
    "TorchAutocastConfig",
    "ZeroConfig",
    "ZeroshardConfig",
    "ZeroshardExtras",
    "PRECISION_KEYS",
    "canonical_dtype_name",
    "requested_collective_timeout_s",
]


class ZeroshardExtras(_Section):
    """``zeroshard``: our own section (not DeepSpeed's).

    Attributes:
        unit_module_classes: dotted or bare class names whose instances become units; None =
            the automatic rule of docs/design.md section 3.
        unit_min_params: units smaller than this merge into the root unit.
        shard_group_size: hybrid sharding: shard over groups of this many consecutive ranks
            and replicate across them (zeroshard/sharding/layout.py); None = shard over every rank.
        skip_nonfinite_steps: skip an optimizer step whose global gradient norm is not finite
            (parameters, optimizer state and scheduler untouched, counted in skipped_steps) in
            fp32 and torch_autocast modes; false keeps DeepSpeed's behaviour there (the step
            runs and the weights become NaN). bf16 mode reads bf16.check_grad_overflow too;
            fp16 always checks (its loss scale needs it).
        collective_timeout_s: seconds a collective may wait for its peers before every
            waiting rank raises CollectiveError naming it (the process groups' timeout).
        hang_timeout_s: seconds a rank may wait in a collective for peers that never reach it
            before the watchdog diagnoses a hang on every rank (zeroshard/comm/watchdog.py);
            None = 300, or half of collective_timeout_s when that is below 600; 0 = no watchdog.
            Must be below collective_timeout_s (checked in the resolve pass).
        hang_first_step_timeout_s: the same for a process's first optimizer step (warm-up);
            None = halfway between hang_timeout_s and collective_timeout_s.
        peak_tflops: this device's peak TFLOP/s, the flops_profiler's MFU denominator
            (DeepSpeed has no key for it); None = the rate of a matmul measured at startup
            of the profile (zeroshard/monitor/flops.py).
        deterministic_reduction: sum each step's micro-batch gradients in one fixed pairwise
            tree, so 1, 2, 4, 8, ... ranks train bit for bit alike (docs/deterministic-reduction.md;
            the configs where it cannot hold are refused: zeroshard/config/deterministic.py).
        fp8: fp8 compute for large Linear layers (zeroshard/config/fp8.py).
        memory_budget_gb: GiB (2^30 bytes) a rank may use; `initialize` and the first forward
            refuse a config whose predicted peak exceeds it (docs/memory.md). Unset: the
            accelerator's memory (no check on the CPU); null: no check.
    """

    unit_module_classes: list[str] | None = None
    unit_min_params: JsonInt = Field(0, ge=0)
    shard_group_size: JsonInt | None = Field(None, ge=1)
    skip_nonfinite_steps: bool = True
    collective_timeout_s: float = Field(DEFAULT_COLLECTIVE_TIMEOUT_S, gt=0)
    hang_timeout_s: float | None = Field(None, ge=0)
    hang_first_step_timeout_s: float | None = Field(None, gt=0)
    peak_tflops: float | None = Field(None, gt=0)
    deterministic_reduction: bool = False
    fp8: Fp8Config = Field(default_factory=Fp8Config)
    memory_budget_gb: float | None = Field(None, gt=0)


class ZeroshardConfig(_Section):
    """A validated, resolved zeroshard config. Build it with
    ``zeroshard.resolve.rules.resolve_config``.

    The batch-size triangle is resolved for the world size given to ``resolve_config`` (so the
    three batch fields are ints afterwards). ``defaults_applied``, ``no_effect_keys``,
    ``derived_keys``, ``raw`` and ``world_size`` describe how it was built.
    """

    train_batch_size: JsonInt | None = Field(None, ge=1)
    train_micro_batch_size_per_gpu: JsonInt | None = Field(None, ge=1)
    gradient_accumulation_steps: JsonInt | None = Field(None, ge=1)
    # False: every engine.step() is the accumulation boundary (DeepSpeed 0.19's unmanaged mode).
    managed_gradient_accumulation: bool = True
    optimizer: OptimizerConfig | None = None
    scheduler: SchedulerConfig | None = None
    gradient_clipping: float = Field(1.0, ge=0)
    fp16: FP16Config = Field(default_factory=FP16Config)
    bf16: BF16Config = Field(default_factory=BF16Config)
    torch_autocast: TorchAutocastConfig = Field(default_factory=TorchAutocastConfig)
    data_types: DataTypesConfig = Field(default_factory=DataTypesConfig)
    communication_data_type: str | None = None
    zero_optimization: ZeroConfig = Field(default_factory=ZeroConfig)
    steps_per_print: StepsPerPrint = 10  # or Infinity: never (zeroshard/config/integration_values.py)
    seed: JsonInt | None = None
    dataloader_drop_last: bool = False
    # Ulysses sequence parallelism (docs/sequence-parallel.md): world = data x sequence ranks.
    sequence_parallel_size: JsonInt = Field(1, ge=1)
    data_parallel_size: JsonInt | None = Field(None, ge=1)
    zeroshard: ZeroshardExtras = Field(default_factory=ZeroshardExtras)
    # AutoEP: swap a Hugging Face model's MoE blocks for expert-parallel layers (docs/moe.md).
    expert_parallel: ExpertParallelConfig = Field(default_factory=ExpertParallelConfig)
    # AutoTP: split Linear layers over groups of consecutive ranks (docs/tensor-parallel.md).
    tensor_parallel: TensorParallelConfig = Field(default_factory=TensorParallelConfig)
    # engine.compile(): torch.compile unit by unit; DeepCompile's keys refused (zeroshard/config/compile.py).
    compile: CompileConfig = Field(default_factory=CompileConfig)
    # zeroshard/monitor/: the step-time breakdown, FLOPs/MFU and the collective summary.
    wall_clock_breakdown: bool = False
    flops_profiler: dict[str, Any] | None = None
    comms_logger: dict[str, Any] | None = None
    # Permits a user optimizer outside zeroshard.optim.untested's list (DeepSpeed's key).
    zero_allow_untested_optimizer: bool = False
    # Accepted, no effect: logging, monitoring and permission knobs.
    memory_breakdown: bool = False
    dump_state: bool = False
    zero_force_ds_cpu_optimizer: bool = True
    vocabulary_size: JsonInt | None = None
    # Monitors (zeroshard/config/monitor.py; the writers are zeroshard/monitor/).
    tensorboard: TensorBoardConfig = Field(default_factory=TensorBoardConfig)
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    csv_monitor: CsvMonitorConfig = Field(default_factory=CsvMonitorConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    # Save together and exit on a scheduler's signal; resume (zeroshard/config/preemption.py).
    preemption: PreemptionConfig = Field(default_factory=PreemptionConfig)
    aio: dict[str, Any] | None = None
    timers: dict[str, Any] | None = None
    seq_parallel_communication_data_type: str | None = None
    use_data_before_expert_parallelism: bool = False
    log_level: str | None = None

    @field_validator("communication_data_type")
    @classmethod
    def _check_dtype(cls, value: str | None) -> str | None:
        return _validate_dtype_name(value)

    NO_EFFECT: ClassVar[frozenset[str]] = frozenset(
        {
            "memory_breakdown", "dump_state",
            "zero_force_ds_cpu_optimizer", "vocabulary_size", "aio", "timers",
            "seq_parallel_communication_data_type", "use_data_before_expert_parallelism", "log_level",
        }
    )
    UNLISTED_DEFAULTS: ClassVar[frozenset[str]] = frozenset(
        {"optimizer", "scheduler", "seed", "train_batch_size", "train_micro_batch_size_per_gpu",
         "gradient_accumulation_steps", "sequence_parallel_size", "data_parallel_size",
         "tensorboard", "wandb", "csv_monitor", "preemption", "tensor_parallel", "compile"}
    )
    NOT_SUPPORTED: ClassVar[dict[str, _Unsupported]] = {
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
        "weight_quantization": _Unsupported(_empty, "Remove it."),
        "sparse_gradients": _Unsupported(_equals(False), "Gradients are dense; remove it."),
        "prescale_gradients": _Unsupported(
            _equals(False), "Gradients are averaged after the reduction; remove it."
        ),
        "gradient_predivide_factor": _Unsupported(_equals(1.0), "Remove it (the factor is always 1)."),
        "gradient_allreduce_op": _Unsupported(
            _equals("mean"), "Gradients are always averaged over the ranks (\"mean\"); remove it."
        ),
        "disable_allgather": _Unsupported(_equals(False), "Remove it."),
        "graph_harvesting": _Unsupported(_equals(False), "Remove it."),
        "zero_optimization_stage": _Unsupported(lambda v: False, "Use zero_optimization.stage."),
        "comet": _Unsupported(_disabled_section, COMET_REFUSAL + "."),
        "datastates_ckpt": _Unsupported(_disabled_section, "Remove it (checkpoints are written by zeroshard)."),
    }

    _defaults_applied: list[str] = PrivateAttr(default_factory=list)
    _derived_keys: list[str] = PrivateAttr(default_factory=list)
    _no_effect_keys: list[str] = PrivateAttr(default_factory=list)
    _raw: dict[str, Any] = PrivateAttr(default_factory=dict)
    _world_size: int = PrivateAttr(default=1)
    _precision_plan: Any = PrivateAttr(default=None)
    _stage_policy: Any = PrivateAttr(default=None)

    # Legacy spellings of a section, read when the current one is absent (as DeepSpeed does).
    LEGACY_SECTIONS: ClassVar[dict[str, str]] = {"bfloat16": "bf16"}

    @property
    def precision_plan(self) -> Any:
        """The resolved PrecisionPlan (zeroshard.precision.plan); set by ``resolve_config``."""
        return _resolved(self._precision_plan, "precision_plan")

    @property
    def stage_policy(self) -> Any:
        """The StagePolicy (zeroshard.sharding.stages) of ``zero_optimization.stage``; set by
        ``resolve_config``."""
        return _resolved(self._stage_policy, "stage_policy")

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

    def get(self, key: str, default: Any = None) -> Any:
        """`raw.get(key, default)`: DeepSpeed's `engine.config` is the dict the user passed, and
        the Hugging Face Trainer reads it so (`engine.config.get("zero_optimization", {})`)."""
        return self._raw.get(key, default)


def _resolved(value: Any, name: str) -> Any:
    if value is None:
        raise AttributeError(
            f"this config was only checked key by key, so it has no {name}: "
            "zeroshard.resolve.rules.resolve_config gives the resolved config."
        )
    return value


# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------


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


# A component's own rule for a section, given by the resolve pass: (the section as written,
# its written JSON path) -> problems. The schema itself imports no component.
SectionRule = Callable[[dict[str, Any], str], list[str]]


def _walk(
    section: type[_Section], raw: dict[str, Any], path: str, report: _Report,
    section_rules: Mapping[str, SectionRule],
) -> dict[str, Any]:
    """Classify every key of ``raw``; return the part pydantic should validate."""
    cleaned: dict[str, Any] = {}
    legacy = getattr(section, "LEGACY_SECTIONS", {})
    for written, value in raw.items():
        key_path = _join(path, written)
        if not isinstance(written, str):
            report.problems.append(f"{key_path}: keys must be strings.")
            continue
        if _find_autos(value, key_path, report):
            continue
        key = section.ALIASES.get(written) or legacy.get(written) or written
        if key != written:
            if key in raw:
                report.problems.append(
                    f"{key_path}={_show(value)}: DeepSpeed's other name for '{_join(path, key)}', which is "
                    f"given too. Keep one of them."
                )
                continue
            report.written_as[_join(path, key)] = key_path
        if key in section.model_fields:
            sub = _section_class(section.model_fields[key].annotation)
            if sub is not None and isinstance(value, dict):
                cleaned[key] = _walk(sub, value, key_path, report, section_rules)
                sub.check_extra(value, key_path, report)
                if (rule := section_rules.get(_join(path, key))) is not None:
                    report.problems.extend(rule(value, key_path))
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
        elif not path and dotted_top_level_key(written, section, _section_class):
            # TRL's "zero_optimization.reduce_bucket_size" at the top level: DeepSpeed reads no such key.
            report.no_effect.append(f'"{written}" (a top-level key: DeepSpeed reads no dotted key)')
            report.no_effect_changed.append(report.no_effect[-1])
        else:
            report.problems.append(
                f"{key_path}: unknown key." + did_you_mean(key, section.json_keys(), key_path=key_path)
            )
    return cleaned


_TYPE_RULES = {
    "int_type": "must be an integer",
    "int_from_float": "must be an integer",
    "float_type": "must be a number",
    "bool_type": "must be true or false",
    "string_type": "must be a string",
    "list_type": "must be a list",
}


def _type_fix(value: Any, rule: str) -> str:
    """How to write ``value`` so that it meets a type rule."""
    if isinstance(value, str):
        text = value.strip()
        if text.lower() in ("true", "false") and "true or false" in rule:
            return f"Write {text.lower()} without quotes."
        try:
            number = float(text)
        except ValueError:
            number = None
        if number is not None and "true or false" not in rule:
            return f"Write {text} without quotes."
    if isinstance(value, bool):
        return "Write a number, not true or false." if "true or false" not in rule else ""
    if "true or false" in rule:
        return "Write true or false (a JSON boolean)."
    if "integer" in rule and isinstance(value, float):
        return "Write a whole number."
    if "string" in rule:
        return "Write it in double quotes."
    if "list" in rule:
        return "Write a JSON list: [...]."
    return "Write a number without quotes."


def _written_path(path: str, report: _Report) -> str:
    for validated, written in report.written_as.items():
        if path == validated or path.startswith(validated + "."):
            return written + path[len(validated):]
    return path


def _pydantic_problems(error: ValidationError, report: _Report) -> list[str]:
    problems = []
    for item in error.errors():
        path = _written_path(".".join(str(p) for p in item["loc"]), report)
        message = str(item["msg"]).removeprefix("Value error, ").rstrip(".")
        value = item.get("input")
        if item["type"] == "missing":
            problems.append(f"{path}: required key is missing.")
        elif item["type"] in _TYPE_RULES:
            rule = _TYPE_RULES[item["type"]]
            problems.append(f"{path}={_show(value)}: {rule}. {_type_fix(value, rule)}".rstrip())
        else:
            end = "" if message.endswith(("?", ".")) else "."
            problems.append(f"{path}={_show(value)}: {message}{end}")
    return problems


def _drop(cleaned: dict[str, Any], loc: tuple[Any, ...]) -> None:
    """Remove the value at ``loc`` (or its nearest existing parent key) from ``cleaned``."""
    node: Any = cleaned
    for i, part in enumerate(loc):
        if not isinstance(node, dict) or part not in node:
            return
        if i == len(loc) - 1 or not isinstance(node[part], dict):  # a leaf, or inside a list
            del node[part]
            return
        node = node[part]


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


_warned_no_effect: set[str] = set()


def _read_raw(raw: dict | str | os.PathLike) -> dict[str, Any]:
    if isinstance(raw, dict):
        check_depth(raw, "the config dict")
        return raw
    if isinstance(raw, (str, os.PathLike)):
        return read_config_file(Path(raw))
    raise ConfigError(f"config must be a dict or a path to a JSON file, not {type(raw).__name__}.")


# Top-level keys whose problems make the precision plan meaningless to resolve.
PRECISION_KEYS = frozenset({"fp16", "bf16", "bfloat16", "torch_autocast", "data_types", "communication_data_type"})


def requested_collective_timeout_s(raw: dict | str | os.PathLike) -> float | None:
    """``zeroshard.collective_timeout_s`` from a raw config when it is a positive number, else
    None (the default applies; a bad value is reported by ``_check_config`` like any other)."""
    try:
        data = raw if isinstance(raw, dict) else read_config_file(Path(raw))
        value = data.get("zeroshard", {}).get("collective_timeout_s")
    except (ConfigError, AttributeError):
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
        return float(value)
    return None


def _check_config(
    raw: dict | str | os.PathLike, world_size: int = 1, sequence_parallel_size: int | None = None,
    section_rules: Mapping[str, SectionRule] | None = None,
) -> tuple[ZeroshardConfig | None, list[str], set[str]]:
    """Check every key of a config; the first half of ``resolve_config``.

    ``world_size`` counts every rank; the batch triangle counts data-parallel replicas,
    ``world_size / sequence_parallel_size`` (the key, or the argument when the caller already
    has sequence-parallel groups, e.g. from an mpu: then the key must agree or be left out).
    ``section_rules`` are the components' rules for sections (by JSON path, e.g. "scheduler"),
    reported with that section's own problems.

    Returns:
        ``(config, problems, tainted)``: the config with defaults filled in and the batch
        triangle resolved (the keys that broke a rule left at their defaults, so that the
        checks across sections can still run; None only when nothing validates), every
        problem found, and the top-level keys that had one.

    Raises:
        ConfigError: when ``raw`` cannot be read at all (a bad file, a bad world size).
    """
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ConfigError(f"world_size={world_size!r}: must be a positive integer.")
    data = _read_raw(raw)
    report = _Report()
    cleaned = _walk(ZeroshardConfig, data, "", report, section_rules or {})
    problems = list(report.problems)
    tainted = {p.split(".")[0].split("=")[0].split(":")[0] for p in problems}
    cfg = None
    for _ in range(8):  # drop what failed and validate again, to check the rest
        try:
            cfg = ZeroshardConfig.model_validate(cleaned)
            break
        except ValidationError as exc:
            if cfg is None and not problems[len(report.problems):]:
                problems.extend(_pydantic_problems(exc, report))
            for item in exc.errors():
                tainted.add(str(item["loc"][0]) if item["loc"] else "")
                _drop(cleaned, item["loc"])
    if cfg is None:
        return None, problems, tainted
    cfg._raw = copy.deepcopy(data)
    cfg._world_size = world_size
    cfg._no_effect_keys = list(report.no_effect)
    fp16_path = report.written_as.get("fp16", "fp16")
    if not cfg.fp16.enabled or cfg.fp16.loss_scale > 0:
        # Dynamic-scaling knobs beside a static scale or with fp16 off: DeepSpeed accepts them
        # and so do we, as "accepted, no effect" (listed, and warned about once).
        written = data.get(fp16_path) if isinstance(data.get(fp16_path), dict) else {}
        for key in FP16Config.DYNAMIC_ONLY:
            if key in written:
                cfg._no_effect_keys.append(f"{fp16_path}.{key}")
                if written[key] != FP16Config.model_fields[key].default:
                    report.no_effect_changed.append(f"{fp16_path}.{key}")
    _collect_defaults(cfg, cleaned, "", cfg._defaults_applied)
    if cfg.zero_optimization.overlap_comm is None:
        cfg.zero_optimization.__dict__["overlap_comm"] = cfg.zero_optimization.overlap_comm_resolved
    data_parallel = data_parallel_size(cfg, data, world_size, sequence_parallel_size, problems)
    if not tainted & set(BATCH_KEYS):
        problems.extend(resolve_batch_triangle(cfg, data_parallel))
    if not problems:
        new_warnings = [k for k in report.no_effect_changed if k not in _warned_no_effect]
        if new_warnings:
            _warned_no_effect.update(new_warnings)
            warnings.warn(
                "zeroshard accepts these DeepSpeed keys but they change nothing here: " + ", ".join(new_warnings),
                UserWarning,
                stacklevel=3,
            )
    return cfg, problems, tainted
