"""``tensor_parallel``: AutoTP, DeepSpeed 0.19.8's section that splits a model's Linear layers
over groups of ``autotp_size`` consecutive ranks (zeroshard/autotp/, docs/tensor-parallel.md).

The keys are DeepSpeed's (``TPTrainingConfig`` and its ``tp`` sub-section ``TPConfig``). What
the layers are split by (``preset_model``, ``partition_config``, or the model's own tp_plan) is
decided against the model at ``initialize`` (zeroshard/autotp/plan.py); this section checks
what the JSON alone can say.
"""

from __future__ import annotations

import re
from typing import Any, ClassVar

from pydantic import Field, field_validator

from zeroshard.config.base import JsonInt, _equals, _Report, _Section, _Unsupported, canonical_dtype_name

__all__ = ["TensorParallelConfig", "TPConfig", "AUTOTP_PRESETS", "PARTITION_CONFIG_KEYS", "LAYER_SPEC_KEYS"]

# DeepSpeed 0.19.8's AutoTPPresets.get_preset names (zeroshard/autotp/specs.py builds them).
AUTOTP_PRESETS = ("llama", "bloom", "chatglm", "mixtral", "deepseek_v2", "qwen2", "phi3")
PARTITION_CONFIG_KEYS = (
    "tp_size", "layer_specs", "embedding_partition_dim", "lm_head_patterns", "use_default_specs", "strict_mode",
)
LAYER_SPEC_KEYS = ("patterns", "partition_type", "shape", "partition_dim", "model_types", "gather_output",
                   "grad_allreduce")


class TPConfig(_Section):
    """``tensor_parallel.tp`` (DeepSpeed's ``TPConfig``; also spelled ``tensor_parallel``).

    Attributes:
        tp_size: must be 1 or equal ``autotp_size`` (DeepSpeed's check).
        tp_grain_size: DeepSpeed's split granularity; only 1 (even splits) here.
    """

    tp_size: JsonInt = Field(1, ge=1)
    tp_grain_size: JsonInt = Field(1, ge=1)

    NOT_SUPPORTED: ClassVar[dict[str, _Unsupported]] = {
        "mpu": _Unsupported(lambda v: v is None, "zeroshard builds the tensor-parallel group itself; remove it."),
        "tp_group": _Unsupported(
            lambda v: v is None,
            "zeroshard builds the tensor-parallel group itself (consecutive ranks); remove it.",
        ),
    }

    @field_validator("tp_grain_size")
    @classmethod
    def _even_only(cls, value: int) -> int:
        if value != 1:
            raise ValueError("zeroshard splits every dimension evenly; only 1 is supported. Remove it")
        return value


class TensorParallelConfig(_Section):
    """``tensor_parallel`` (AutoTP).

    Attributes:
        autotp_size: ranks each tensor-parallel group spans (consecutive ranks, DeepSpeed's
            placement); 0 or 1: off. Must divide the world size.
        dtype: DeepSpeed's model dtype for AutoTP; here only a check: it must name the
            precision the config trains in ("bf16", "fp16", "fp32").
        preset_model: DeepSpeed's built-in rules (llama, bloom, chatglm, mixtral, deepseek_v2,
            qwen2, phi3).
        partition_config: DeepSpeed's custom rules: ``layer_specs`` (patterns, partition_type,
            shape, partition_dim, model_types, gather_output, grad_allreduce),
            ``use_default_specs``, ``strict_mode``, ``lm_head_patterns``,
            ``embedding_partition_dim``, ``tp_size``.
        vocab_parallel_lm_head: DeepSpeed's vocabulary-parallel output head; null or false
            (true is refused: not supported).
        tp_overlap_comm: accepted, no effect (the exchanges are issued in order on the
            compute stream).
        tp: ``TPConfig`` (``tp_size``, ``tp_grain_size``).
    """

    autotp_size: JsonInt = Field(0, ge=0)
    dtype: str | None = None
    preset_model: str | None = None
    partition_config: dict[str, Any] | None = None
    vocab_parallel_lm_head: bool | None = None
    tp_overlap_comm: bool = False
    tp: TPConfig = Field(default_factory=TPConfig)

    NO_EFFECT: ClassVar[frozenset[str]] = frozenset({"tp_overlap_comm"})
    UNLISTED_DEFAULTS: ClassVar[frozenset[str]] = frozenset(
        {"dtype", "preset_model", "partition_config", "vocab_parallel_lm_head", "tp"}
    )
    ALIASES: ClassVar[dict[str, str]] = {"tensor_parallel": "tp"}
    NOT_SUPPORTED: ClassVar[dict[str, _Unsupported]] = {
        "vocab_parallel_ce_backend": _Unsupported(
            _equals("torch"), "Only the PyTorch loss exists here (no vocabulary-parallel head); remove it."
        ),
        "keep_module_on_host": _Unsupported(
            _equals(False), "An inference-loading option: the split weights live with the flats; remove it."
        ),
        "replace_with_kernel_inject": _Unsupported(_equals(False), "Inference kernels are not supported; remove it."),
        "kernel_inject": _Unsupported(_equals(False), "Inference kernels are not supported; remove it."),
        "injection_policy_tuple": _Unsupported(
            lambda v: v is None, "Name the layers with partition_config (or preset_model) instead."
        ),
    }

    @property
    def size(self) -> int:
        """The tensor-parallel size (1 when off)."""
        return max(1, self.autotp_size)

    @field_validator("dtype")
    @classmethod
    def _dtype_name(cls, value: str | None) -> str | None:
        if value is not None:
            canonical_dtype_name(value)
        return value

    @field_validator("preset_model")
    @classmethod
    def _known_preset(cls, value: str | None) -> str | None:
        if value is not None and value.lower() not in AUTOTP_PRESETS:
            raise ValueError(f"unknown preset. Use one of {', '.join(AUTOTP_PRESETS)}, or give partition_config")
        return value

    @field_validator("vocab_parallel_lm_head")
    @classmethod
    def _no_vocab_parallel(cls, value: bool | None) -> bool | None:
        if value:
            raise ValueError(
                "recognised DeepSpeed key, not supported by zeroshard (the vocabulary-parallel head and loss). "
                "Set it false or null: the head is split by column and its logits gathered"
            )
        return value

    @classmethod
    def check_extra(cls, raw: dict[str, Any], path: str, report: _Report) -> None:
        size = raw.get("autotp_size", 0)
        tp = raw.get("tp", raw.get("tensor_parallel"))
        if isinstance(tp, dict) and isinstance(size, int) and size > 1:
            tp_size = tp.get("tp_size", 1)
            if isinstance(tp_size, int) and tp_size not in (1, size):
                report.problems.append(
                    f"{path}.tp.tp_size={tp_size}: must be 1 or equal {path}.autotp_size ({size}). Remove it."
                )
        partition = raw.get("partition_config")
        if partition is not None:
            report.problems.extend(_partition_config_problems(partition, f"{path}.partition_config"))


def _partition_config_problems(value: Any, path: str) -> list[str]:
    """What is wrong with a DeepSpeed partition_config, each problem with its JSON path."""
    if not isinstance(value, dict):
        return [f"{path}={value!r}: must be an object with layer_specs. Write {{\"layer_specs\": [...]}}."]
    problems = [
        f"{path}.{key}: unknown key. Use {', '.join(PARTITION_CONFIG_KEYS)}." for key in value
        if key not in PARTITION_CONFIG_KEYS
    ]
    if value.get("embedding_partition_dim", 1) != 1:
        problems.append(f"{path}.embedding_partition_dim={value['embedding_partition_dim']}: embeddings stay whole "
                        "in zeroshard; remove it.")
    specs = value.get("layer_specs", [])
    if not isinstance(specs, list):
        return [*problems, f"{path}.layer_specs: must be a list of objects."]
    for i, spec in enumerate(specs):
        at = f"{path}.layer_specs.{i}"
        if not isinstance(spec, dict):
            problems.append(f"{at}: must be an object with patterns and partition_type.")
            continue
        problems.extend(f"{at}.{key}: unknown key. Use {', '.join(LAYER_SPEC_KEYS)}." for key in spec
                        if key not in LAYER_SPEC_KEYS)
        patterns = spec.get("patterns")
        if not isinstance(patterns, list) or not patterns or not all(isinstance(p, str) for p in patterns):
            problems.append(f"{at}.patterns: must be a non-empty list of regular expressions.")
        else:
            for pattern in patterns:
                try:
                    re.compile(pattern)
                except re.error as error:
                    problems.append(f"{at}.patterns: {pattern!r} is not a regular expression ({error}).")
        kind = spec.get("partition_type", "column")
        if not isinstance(kind, str) or kind.lower() not in ("column", "row", "skip"):
            problems.append(f"{at}.partition_type={kind!r}: use 'column', 'row' or 'skip'.")
    return problems


def precision_name(dtype: str) -> str:
    """"fp32", "fp16" or "bf16" for a dtype spelling."""
    return canonical_dtype_name(dtype)

