"""Which Linear layers tensor parallelism splits, and how: DeepSpeed 0.19.8's configurable AutoTP
vocabulary (`deepspeed.module_inject.autotp_config`), its built-in presets, and the Hugging Face
`tp_plan` read as the same vocabulary.

A rule is a `TPLayerSpec`: regular expressions matched (`re.match`) against parameter names
(`model.layers.0.self_attn.q_proj.weight`), and what to do with the layer that owns a matching
weight: split its output features (column), its input features (row), or leave it whole (skip).
An `AutoTPConfig` is an ordered list of rules; the first match wins, as in DeepSpeed.

Where the rules come from, in DeepSpeed's order of priority (docs/tensor-parallel.md):
1. `tensor_parallel.partition_config` and/or `tensor_parallel.preset_model` (merged when the
   partition config keeps `use_default_specs`);
2. the model's own plan: `config.base_model_tp_plan`, the class's `_tp_plan` and the instance's
   `_tp_plan`, merged as DeepSpeed's `_get_hf_tp_plan` merges them;
3. nothing: zeroshard refuses to guess (DeepSpeed 0.19.8 falls back to a name heuristic).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

__all__ = [
    "PartitionType",
    "TPLayerSpec",
    "AutoTPConfig",
    "AutoTPPresets",
    "merge_autotp_configs",
    "HF_PLAN_STYLES",
    "hf_tp_plan",
    "specs_from_hf_plan",
]


class PartitionType(Enum):
    """How a layer is split across the tensor-parallel group (DeepSpeed's names and values)."""

    COLUMN = "column"  # output features split; the input's gradient is summed over the group
    ROW = "row"  # input features split; the output is summed over the group
    SKIP = "skip"  # left whole on every rank


Shape = tuple[Any, ...]
logger = logging.getLogger("zeroshard")
_WARNED_OVERLAPS: set[tuple[tuple[str, ...], ...]] = set()


def _as_tuple(shape: Any) -> Any:
    if isinstance(shape, (list, tuple)):
        return tuple(_as_tuple(item) for item in shape)
    return shape


@dataclass
class TPLayerSpec:
    """One rule (DeepSpeed's `TPLayerSpec`, the same fields and defaults).

    Attributes:
        patterns: regular expressions, `re.match`ed against the full parameter name.
        partition_type: COLUMN, ROW or SKIP (or their string values).
        shape: the weight seen as sub-parameters before splitting, e.g. `(3, -1)` for a fused
            [q; k; v] projection or `((q, k, v), -1)` for unequal ones (GQA): each
            sub-parameter is split on its own, so every rank holds its slice of each. None:
            the weight as it is.
        partition_dim: the dimension split (after `shape`); default 0 for COLUMN, 1 for ROW.
        model_types: apply only to models whose `config.model_type` is one of these.
        gather_output: COLUMN only: all-gather the output so every rank gets it whole (an
            untied LM head, HF's `colwise_gather_output`).
        grad_allreduce: SKIP only: the parameter stays whole but acts on split activations
            (Qwen3's q_norm/k_norm), so its gradient is summed over the group (HF's
            `replicated_with_grad_allreduce`).
    """

    patterns: list[str]
    partition_type: PartitionType | str = PartitionType.COLUMN
    shape: Shape | None = None
    partition_dim: int | None = None
    model_types: list[str] | None = None
    gather_output: bool = False
    grad_allreduce: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.partition_type, str):
            try:
                self.partition_type = PartitionType(self.partition_type.lower())
            except ValueError:
                raise ValueError(
                    f"partition_type={self.partition_type!r}: not a partition type. Use 'column', 'row' or 'skip'."
                ) from None
        if isinstance(self.patterns, str):
            self.patterns = [self.patterns]
        for pattern in self.patterns:
            try:
                re.compile(pattern)
            except re.error as error:
                raise ValueError(f"patterns: {pattern!r} is not a regular expression ({error}).") from None
        if self.shape is not None:
            self.shape = _as_tuple(self.shape)
            self._check_shape()

    def _check_shape(self) -> None:
        shape, dim = self.shape, self.get_partition_dim()
        if not isinstance(shape, tuple) or not 0 <= dim < len(shape):
            raise ValueError(f"shape={shape!r}: partition_dim {dim} is outside it.")
        for i, size in enumerate(shape):
            if isinstance(size, tuple):
                if i != dim or not size or not all(isinstance(s, int) and s > 0 for s in size):
                    raise ValueError(
                        f"shape={shape!r}: a tuple of sizes (unequal sub-parameters) is allowed only at the "
                        "partition dimension, one level deep, of positive integers."
                    )
            elif not isinstance(size, int) or size == 0 or size < -1:
                raise ValueError(f"shape={shape!r}: dimensions are positive integers or -1.")

    def get_partition_dim(self) -> int:
        if self.partition_dim is not None:
            return self.partition_dim
        return 0 if self.partition_type == PartitionType.COLUMN else 1

    def sub_param_sizes(self, length: int) -> list[int] | None:
        """The sizes of the sub-parameters along the split dimension, for a weight whose split
        dimension has `length` elements (None: no sub-parameters)."""
        if self.shape is None:
            return None
        at = self.shape[self.get_partition_dim()]
        if isinstance(at, tuple):
            return list(at)
        if at in (-1, 1):
            return None
        if length % at:
            raise ValueError(f"shape={self.shape!r}: {at} sub-parameters do not divide {length}.")
        return [length // at] * at

    def matches(self, param_name: str, model_type: str | None = None) -> bool:
        if self.model_types:
            if model_type is None or str(model_type).lower() not in {str(t).lower() for t in self.model_types}:
                return False
        return any(re.match(pattern, param_name) for pattern in self.patterns)


@dataclass
class AutoTPConfig:
    """An ordered list of rules and the options around them (DeepSpeed's `AutoTPConfig`).

    Attributes:
        tp_size: the tensor-parallel size (set from `tensor_parallel.autotp_size`).
        layer_specs: the rules, first match wins.
        embedding_partition_dim: DeepSpeed's dimension for embeddings a rule splits (zeroshard
            keeps embeddings whole: a rule that splits one is refused).
        lm_head_patterns: last name segments that mark the output head.
        use_default_specs: merge with `preset_model`'s rules (this config's come first).
        strict_mode: a Linear layer that no rule matches is an error instead of staying whole.
    """

    tp_size: int = 1
    layer_specs: list[TPLayerSpec] = field(default_factory=list)
    embedding_partition_dim: int = 1
    lm_head_patterns: list[str] = field(default_factory=lambda: ["lm_head", "embed_out"])
    use_default_specs: bool = True
    strict_mode: bool = False

    def find_matching_spec(self, param_name: str, model_type: str | None = None) -> TPLayerSpec | None:
        found = [spec for spec in self.layer_specs if spec.matches(param_name, model_type)]
        if len(found) > 1:
            key = tuple(tuple(spec.patterns) for spec in found)
            if key not in _WARNED_OVERLAPS:  # once per set of rules, as DeepSpeed's warning_once
                _WARNED_OVERLAPS.add(key)
                logger.warning("AutoTP: %s matches %d layer_specs; the first (%s) applies.", param_name, len(found),
                               found[0].patterns)
        return found[0] if found else None

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> AutoTPConfig:
        """DeepSpeed's JSON form (`tensor_parallel.partition_config`)."""
        specs = []
        for entry in config.get("layer_specs", []):
            specs.append(
                TPLayerSpec(
                    patterns=list(entry.get("patterns", [])),
                    partition_type=entry.get("partition_type", "column"),
                    shape=entry.get("shape"),
                    partition_dim=entry.get("partition_dim"),
                    model_types=entry.get("model_types"),
                    gather_output=bool(entry.get("gather_output", False)),
                    grad_allreduce=bool(entry.get("grad_allreduce", False)),
                )
            )
        return cls(
            tp_size=config.get("tp_size", 1),
            layer_specs=specs,
            embedding_partition_dim=config.get("embedding_partition_dim", 1),
            lm_head_patterns=list(config.get("lm_head_patterns", ["lm_head", "embed_out"])),
            use_default_specs=config.get("use_default_specs", True),
            strict_mode=config.get("strict_mode", False),
        )


def merge_autotp_configs(base: AutoTPConfig, override: AutoTPConfig) -> AutoTPConfig:
    """`override`'s rules first, then `base`'s; `override`'s options (DeepSpeed's merge)."""
    return AutoTPConfig(
        tp_size=override.tp_size if override.tp_size > 1 else base.tp_size,
        layer_specs=[*override.layer_specs, *base.layer_specs],
        embedding_partition_dim=override.embedding_partition_dim,
        lm_head_patterns=override.lm_head_patterns or base.lm_head_patterns,
        use_default_specs=override.use_default_specs,
        strict_mode=override.strict_mode,
    )


# ------------------------------------------------------------------------------ presets


def _spec(pattern: str, kind: PartitionType, **extra: Any) -> TPLayerSpec:
    return TPLayerSpec(patterns=[pattern], partition_type=kind, **extra)


_C, _R, _S = PartitionType.COLUMN, PartitionType.ROW, PartitionType.SKIP


class AutoTPPresets:
    """DeepSpeed 0.19.8's built-in rule sets, by `tensor_parallel.preset_model` name."""

    @staticmethod
    def llama() -> AutoTPConfig:
        """Separate q, k, v projections; gate/up and down projections."""
        return AutoTPConfig(layer_specs=[
            _spec(r".*\.self_attn\.o_proj\.weight$", _R),
            _spec(r".*\.self_attn\.[qkv]_proj\.weight$", _C),
            _spec(r".*\.mlp\.down_proj\.weight$", _R),
            _spec(r".*\.mlp\.(up|gate)_proj\.weight$", _C),
        ])

    @staticmethod
    def llama_gqa(num_heads: int, num_kv_heads: int, head_dim: int) -> AutoTPConfig:
        """A fused qkv_proj holding q, k and v of unequal sizes (grouped-query attention)."""
        q, kv = num_heads * head_dim, num_kv_heads * head_dim
        return AutoTPConfig(layer_specs=[
            _spec(r".*\.self_attn\.o_proj\.weight$", _R),
            _spec(r".*\.self_attn\.qkv_proj\.weight$", _C, shape=((q, kv, kv), -1), partition_dim=0),
            _spec(r".*\.mlp\.down_proj\.weight$", _R),
            _spec(r".*\.mlp\.(up|gate)_proj\.weight$", _C),
        ])

    @staticmethod
    def bloom() -> AutoTPConfig:
        """A fused query_key_value with heads interleaved ([q1,k1,v1,q2,...]): split as it is."""
        return AutoTPConfig(layer_specs=[
            _spec(r".*\.self_attention\.dense\.weight$", _R),
            _spec(r".*\.self_attention\.query_key_value\.weight$", _C),
            _spec(r".*\.mlp\.dense_4h_to_h\.weight$", _R),
            _spec(r".*\.mlp\.dense_h_to_4h\.weight$", _C),
        ])

    @staticmethod
    def chatglm() -> AutoTPConfig:
        """A fused [Q; K; V] and a packed [gate; up]."""
        return AutoTPConfig(layer_specs=[
            _spec(r".*\.self_attention\.dense\.weight$", _R),
            _spec(r".*\.self_attention\.query_key_value\.weight$", _C, shape=(3, -1), partition_dim=0),
            _spec(r".*\.mlp\.dense_4h_to_h\.weight$", _R),
            _spec(r".*\.mlp\.dense_h_to_4h\.weight$", _C, shape=(2, -1), partition_dim=0),
        ])

    @staticmethod
    def mixtral() -> AutoTPConfig:
        """Attention as Llama; each expert's w1/w3 column, w2 row; the router whole."""
        return AutoTPConfig(layer_specs=[
            _spec(r".*\.self_attn\.o_proj\.weight$", _R),
            _spec(r".*\.self_attn\.[qkv]_proj\.weight$", _C),
            _spec(r".*\.block_sparse_moe\.experts\.\d+\.w2\.weight$", _R),
            _spec(r".*\.block_sparse_moe\.experts\.\d+\.w[13]\.weight$", _C),
            _spec(r".*\.block_sparse_moe\.gate\.weight$", _S),
        ])

    @staticmethod
    def deepseek_v2() -> AutoTPConfig:
        """Multi-head latent attention: the low-rank projections whole, the up-projections column."""
        return AutoTPConfig(layer_specs=[
            _spec(r".*\.self_attn\.o_proj\.weight$", _R),
            _spec(r".*\.self_attn\.(q_a_proj|kv_a_proj_with_mqa)\.weight$", _S),
            _spec(r".*\.self_attn\.(q_b_proj|kv_b_proj)\.weight$", _C),
            _spec(r".*\.mlp\.experts\.\d+\.down_proj\.weight$", _R),
            _spec(r".*\.mlp\.experts\.\d+\.(up|gate)_proj\.weight$", _C),
            _spec(r".*\.mlp\.gate\.weight$", _S),
            _spec(r".*\.mlp\.shared_experts\.down_proj\.weight$", _R),
            _spec(r".*\.mlp\.shared_experts\.(up|gate)_proj\.weight$", _C),
        ])

    @staticmethod
    def qwen2() -> AutoTPConfig:
        """As Llama."""
        return AutoTPPresets.llama()

    @staticmethod
    def phi3() -> AutoTPConfig:
        """A fused [Q; K; V] (equal thirds) and a packed gate_up_proj."""
        return AutoTPConfig(layer_specs=[
            _spec(r".*\.self_attn\.o_proj\.weight$", _R),
            _spec(r".*\.self_attn\.qkv_proj\.weight$", _C, shape=(3, -1), partition_dim=0),
            _spec(r".*\.mlp\.down_proj\.weight$", _R),
            _spec(r".*\.mlp\.gate_up_proj\.weight$", _C, shape=(2, -1), partition_dim=0),
        ])

    NAMES = ("llama", "bloom", "chatglm", "mixtral", "deepseek_v2", "qwen2", "phi3")

    @staticmethod
    def get_preset(model_type: str) -> AutoTPConfig | None:
        """The preset of that name (case-insensitive), or None."""
        name = str(model_type).lower()
        return getattr(AutoTPPresets, name)() if name in AutoTPPresets.NAMES else None


# ------------------------------------------------------------------------ Hugging Face plans

# transformers' partition styles that DeepSpeed 0.19.8 reads (`colwise_rep` is the older name
# of `colwise_gather_output`); any other style makes the whole plan unusable.
HF_PLAN_STYLES = (
    "colwise", "colwise_rep", "colwise_gather_output", "rowwise", "replicated_with_grad_allreduce",
    "embedding_rowwise",
)


def hf_tp_plan(model: Any) -> dict[str, str] | None:
    """The model's tensor-parallel plan: `config.base_model_tp_plan`, then the class's `_tp_plan`,
    then the instance's (a later source overrides an earlier one; a `model.`-prefixed key that
    names a pattern already present is the same entry). None when the model has none."""
    config = getattr(model, "config", None)
    sources = (
        getattr(config, "base_model_tp_plan", None),
        getattr(type(model), "_tp_plan", None),
        vars(model).get("_tp_plan") if hasattr(model, "__dict__") else None,
    )
    merged: dict[str, str] = {}
    seen: set[str] = set()
    for plan in sources:
        if not isinstance(plan, dict):
            continue
        for pattern, style in plan.items():
            bare = pattern.removeprefix("model.")
            if pattern.startswith("model.") and bare in seen:
                continue
            merged[pattern] = style
            seen.add(bare)
    return merged or None


def _glob_to_regex(pattern: str) -> str:
    """A plan key (`layers.*.self_attn.q_proj`) as the regex of its weight's names."""
    regex = ".*" + re.escape(pattern).replace(r"\*", ".*")
    return regex + (r"$" if pattern.endswith(".weight") else r"\.weight$")


def specs_from_hf_plan(plan: dict[str, str]) -> list[TPLayerSpec]:
    """The plan's entries as rules, in order (DeepSpeed's `TPPlanConverter.convert`).

    Raises:
        ValueError: a style outside `HF_PLAN_STYLES`: applying the rest could split one half of
            a column/row pair, so the whole plan is refused.
    """
    unknown = sorted({style for style in plan.values() if str(style).lower() not in HF_PLAN_STYLES})
    if unknown:
        raise ValueError(
            f"the model's tp_plan uses partition style(s) {unknown}, which AutoTP does not read (it reads "
            f"{', '.join(HF_PLAN_STYLES)}). Give tensor_parallel.partition_config for this model instead."
        )
    specs = []
    for pattern, style in plan.items():
        style = str(style).lower()
        if style in ("colwise", "colwise_rep", "colwise_gather_output"):
            spec = TPLayerSpec([_glob_to_regex(pattern)], _C, gather_output=style != "colwise")
        elif style == "rowwise":
            spec = TPLayerSpec([_glob_to_regex(pattern)], _R)
        else:  # embedding_rowwise: kept whole; replicated_with_grad_allreduce: whole, gradient summed
            spec = TPLayerSpec([_glob_to_regex(pattern)], _S, grad_allreduce=style == "replicated_with_grad_allreduce")
        specs.append(spec)
    return specs
