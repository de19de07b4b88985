"""Deciding, before anything moves, what tensor parallelism does to each layer of a model.

`plan_tensor_parallel(model, settings, tp_size)` needs no process group (`zeroshard explain`
calls it on a model built on the host), reads the rules (zeroshard/autotp/specs.py) and
returns a `TensorParallelPlan`: one `Placement` per Linear layer (split by column, by row, or
kept whole, and which rule said so) and the parameters whose gradients are summed over the
group. Everything that cannot be placed is refused in one error that names each layer:

- no rules at all (no tp_plan on the model, no preset_model, no partition_config);
- a split that is not even: a dimension (or a packed sub-parameter) not divisible by the size;
- attention heads that do not divide: `autotp_size` above the model's key-value heads
  (grouped-query attention) or not dividing them, or the query heads;
- a rule that splits something other than an `nn.Linear` (an embedding, a Conv1D), a shape
  with more than two dimensions, `gather_output` on packed sub-parameters;
- an output head tied to the embedding under a rule that would split it (DeepSpeed then keeps
  both whole, and so does zeroshard, with a warning, unless `vocab_parallel_lm_head` is true).
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from zeroshard.autotp.specs import (
    AutoTPConfig,
    AutoTPPresets,
    PartitionType,
    TPLayerSpec,
    hf_tp_plan,
    merge_autotp_configs,
    specs_from_hf_plan,
)

__all__ = ["Placement", "TensorParallelPlan", "plan_tensor_parallel", "TensorParallelPlanError", "head_counts"]

COLUMN, ROW, WHOLE = "column", "row", "whole"

# Module attributes DeepSpeed scales to the local share when a module's children are split
# (its `update_mp_params` list); HF models of transformers 5 read shapes with -1 instead.
LOCAL_COUNT_ATTRIBUTES = (
    "n_heads", "inner_dim", "num_heads", "num_kv", "num_attention_heads", "num_attn_heads", "all_head_size",
    "embed_dim", "hidden_size", "num_key_value_heads", "num_kv_heads", "kv_n_heads", "d_model",
)


class TensorParallelPlanError(ValueError):
    """A model tensor parallelism cannot place; `problems` lists each layer's reason."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("tensor parallelism cannot place this model:\n  " + "\n  ".join(problems))


@dataclass(frozen=True)
class Placement:
    """What happens to one Linear layer.

    Attributes:
        name: the module's name.
        kind: "column", "row" or "whole".
        rule: where the decision came from (the plan entry or rule pattern, or "no rule").
        shape: the whole weight's shape.
        sub_sizes: packed sub-parameters along the split dimension (None: one).
        gather_output: column only: the output is gathered whole.
        has_bias: the layer has a bias (split with a column weight, whole with a row one).
    """

    name: str
    kind: str
    rule: str
    shape: tuple[int, ...]
    sub_sizes: tuple[int, ...] | None = None
    gather_output: bool = False
    has_bias: bool = False

    @property
    def dim(self) -> int | None:
        return {COLUMN: 0, ROW: 1}.get(self.kind)


@dataclass
class TensorParallelPlan:
    """Every decision of `plan_tensor_parallel`.

    Attributes:
        tp_size: the tensor-parallel size.
        source: where the rules came from ("partition_config", "preset_model=llama", "tp_plan", ...).
        placements: one per Linear layer, in module order.
        grad_sum: parameters kept whole whose gradient is summed over the group.
        warnings: decisions a user should know of (a tied head kept whole).
    """

    tp_size: int
    source: str
    placements: list[Placement] = field(default_factory=list)
    grad_sum: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def split(self) -> list[Placement]:
        return [p for p in self.placements if p.kind != WHOLE]

    def by_name(self) -> dict[str, Placement]:
        return {p.name: p for p in self.placements}


def head_counts(model: Any) -> tuple[int | None, int | None]:
    """(query heads, key-value heads) from the model's config (its text config for a
    multimodal one), or None where it does not say."""
    config = getattr(model, "config", None)
    config = getattr(config, "text_config", None) or config
    if config is None:
        return None, None
    heads = next((getattr(config, n) for n in ("num_attention_heads", "num_heads", "n_head", "n_heads")
                  if isinstance(getattr(config, n, None), int)), None)
    kv = next((getattr(config, n) for n in ("num_key_value_heads", "num_kv_heads", "multi_query_group_num",
                                            "n_head_kv", "kv_n_heads") if isinstance(getattr(config, n, None), int)),
              heads)
    return heads, kv


def _rules(model: Any, settings: Any, tp_size: int) -> tuple[AutoTPConfig | None, str]:
    """The rules DeepSpeed 0.19.8 would apply, in its priority: partition_config / preset_model,
    then the model's tp_plan."""
    config, source = None, ""
    if settings.preset_model:
        config = AutoTPPresets.get_preset(settings.preset_model)
        source = f"preset_model={settings.preset_model}"
    if settings.partition_config:
        custom = AutoTPConfig.from_dict(dict(settings.partition_config))
        if config is not None and custom.use_default_specs:
            config, source = merge_autotp_configs(config, custom), f"partition_config + {source}"
        else:
            config, source = custom, "partition_config"
    if config is None:
        plan = hf_tp_plan(model)
        if plan:
            config, source = AutoTPConfig(layer_specs=specs_from_hf_plan(plan)), "tp_plan"
    if config is not None:
        config.tp_size = tp_size
    return config, source


def _model_type(model: Any) -> str | None:
    config = getattr(model, "config", None)
    kind = getattr(config, "model_type", None)
    return str(kind).lower() if kind else None


def _rule_text(spec: TPLayerSpec) -> str:
    """The rule as a reader wrote it: a tp_plan key back in its glob form, else the regex."""
    text = spec.patterns[0] if len(spec.patterns) == 1 else str(spec.patterns)
    glob = re.fullmatch(r"\.\*(.+)\\\.weight\$", text)
    if glob and "(" not in text and "[" not in text:
        return glob.group(1).replace(r"\.", ".").replace(".*", "*")
    return text


def plan_tensor_parallel(model: nn.Module, settings: Any, tp_size: int) -> TensorParallelPlan:
    """Decide every Linear layer's split for `tp_size` ranks (see the module docstring).

    Args:
        model: the model, unsplit (parameters on any device; not read).
        settings: the `tensor_parallel` section (preset_model, partition_config,
            vocab_parallel_lm_head).
        tp_size: the tensor-parallel size.

    Raises:
        TensorParallelPlanError: listing every layer that cannot be placed.
    """
    config, source = _rules(model, settings, tp_size)
    problems: list[str] = []
    if config is None:
        name = type(model).__name__
        raise TensorParallelPlanError([
            f"tensor_parallel.autotp_size={tp_size}: {name} has no tensor-parallel plan (no config.base_model_tp_plan "
            "or _tp_plan) and the config names no rules. Set tensor_parallel.preset_model (one of "
            f"{', '.join(AutoTPPresets.NAMES)}) or tensor_parallel.partition_config."
        ])
    plan = TensorParallelPlan(tp_size, source)
    heads, kv_heads = head_counts(model)
    if kv_heads is not None and tp_size > kv_heads:
        problems.append(
            f"tensor_parallel.autotp_size={tp_size}: above the model's {kv_heads} key-value heads "
            "(config.num_key_value_heads): a rank would hold no key-value head. Use an autotp_size that divides "
            f"{kv_heads}."
        )
    elif kv_heads is not None and kv_heads % tp_size:
        problems.append(f"tensor_parallel.autotp_size={tp_size}: does not divide the model's {kv_heads} key-value "
                        "heads; zeroshard splits heads evenly. Use a divisor of the key-value head count.")
    if heads is not None and heads % tp_size:
        problems.append(f"tensor_parallel.autotp_size={tp_size}: does not divide the model's {heads} attention "
                        "heads. Use a divisor of the head count.")
    model_type = _model_type(model)
    weight_owners: dict[int, list[str]] = {}
    for name, module in model.named_modules():
        weight = module._parameters.get("weight") if hasattr(module, "_parameters") else None
        if weight is not None:
            weight_owners.setdefault(id(weight), []).append(name)
    head_names = tuple(config.lm_head_patterns)
    for name, module in model.named_modules():
        if getattr(module, "_is_autoep_layer", False):
            continue
        weight = module._parameters.get("weight") if hasattr(module, "_parameters") else None
        if weight is None:
            continue
        spec = config.find_matching_spec(f"{name}.weight", model_type)
        splits = spec is not None and spec.partition_type != PartitionType.SKIP
        if not isinstance(module, nn.Linear):
            if splits:
                what = "an embedding" if isinstance(module, nn.Embedding) else f"a {type(module).__name__}"
                problems.append(
                    f"{name}: rule {_rule_text(spec)!r} splits {what}; zeroshard splits nn.Linear layers only "
                    "and keeps embeddings whole. Mark it 'skip' in tensor_parallel.partition_config."
                )
            continue
        shape = tuple(weight.ds_shape) if hasattr(weight, "ds_shape") else tuple(weight.shape)
        has_bias = module.bias is not None
        if spec is None:
            if config.strict_mode:
                problems.append(f"{name}: no rule of tensor_parallel.partition_config matches {name}.weight "
                                "(strict_mode). Add a layer_spec for it, or set strict_mode false to keep it whole.")
            plan.placements.append(Placement(name, WHOLE, "no rule", shape, has_bias=has_bias))
            continue
        if not splits:
            plan.placements.append(Placement(name, WHOLE, _rule_text(spec), shape, has_bias=has_bias))
            continue
        kind = COLUMN if spec.partition_type == PartitionType.COLUMN else ROW
        dim = spec.get_partition_dim()
        natural = 0 if kind == COLUMN else 1
        if spec.shape is not None and len(spec.shape) > 2:
            problems.append(f"{name}: rule {_rule_text(spec)!r} views the weight as {list(spec.shape)}; zeroshard "
                            "splits 2-D weights only (per-expert 3-D views are not supported).")
            continue
        if dim != natural:
            problems.append(f"{name}: rule {_rule_text(spec)!r} splits dim {dim} of a {kind}-parallel layer; a {kind} "
                            f"split is along dim {natural}. Remove partition_dim or set it to {natural}.")
            continue
        try:
            sub_sizes = spec.sub_param_sizes(shape[dim])
        except ValueError as error:
            problems.append(f"{name}: {error}")
            continue
        if sub_sizes is not None and sum(sub_sizes) != shape[dim]:
            problems.append(f"{name}: rule {_rule_text(spec)!r}: sub-parameters {sub_sizes} sum to "
                            f"{sum(sub_sizes)}, the weight has {shape[dim]} along dim {dim}.")
            continue
        if spec.gather_output and sub_sizes is not None:
            problems.append(f"{name}: rule {_rule_text(spec)!r}: gather_output with packed sub-parameters is not "
                            "supported (as in DeepSpeed).")
            continue
        uneven = [s for s in (sub_sizes or [shape[dim]]) if s % tp_size]
        if uneven:
            what = "out_features" if kind == COLUMN else "in_features"
            problems.append(
                f"{name}: {what} {shape[dim]}" + (f" (sub-parameters {sub_sizes})" if sub_sizes else "")
                + f" not divisible by tensor_parallel.autotp_size={tp_size}; zeroshard splits evenly. Use a size "
                "that divides it, or mark the layer 'skip' in tensor_parallel.partition_config."
            )
            continue
        is_head = name.split(".")[-1] in head_names
        tied = [other for other in weight_owners.get(id(weight), []) if other != name]
        if tied:
            if settings.vocab_parallel_lm_head:
                problems.append(f"{name}: tensor_parallel.vocab_parallel_lm_head=true: the vocabulary-parallel head "
                                "and embedding are not supported by zeroshard. Set it false (both stay whole).")
                continue
            plan.warnings.append(
                f"{name} shares its weight with {', '.join(tied)}: both stay whole on every rank (as DeepSpeed does "
                "for a tied head without vocab_parallel_lm_head)."
            )
            plan.placements.append(Placement(name, WHOLE, f"{_rule_text(spec)} (tied to {tied[0]})", shape,
                                             has_bias=has_bias))
            continue
        if is_head and kind == ROW:
            problems.append(f"{name}: a row-split output head is not supported by zeroshard. Split it by column "
                            "with gather_output (Hugging Face's colwise_gather_output), or mark it 'skip'.")
            continue
        if is_head and kind == COLUMN and not spec.gather_output:
            problems.append(f"{name}: a column-split output head without gather_output leaves each rank a slice of the "
                            "logits, which needs the vocabulary-parallel loss (vocab_parallel_lm_head), not supported "
                            "by zeroshard. Set gather_output true for it.")
            continue
        plan.placements.append(Placement(name, kind, _rule_text(spec), shape,
                                         tuple(sub_sizes) if sub_sizes else None,
                                         spec.gather_output and kind == COLUMN, has_bias))
    if settings.vocab_parallel_lm_head and not any(
        p.name.split(".")[-1] in head_names for p in plan.placements
    ):
        problems.append("tensor_parallel.vocab_parallel_lm_head=true: the vocabulary-parallel head is not supported "
                        "by zeroshard. Leave it null or false.")
    for pname, _ in model.named_parameters():
        spec = config.find_matching_spec(pname, model_type)
        if spec is not None and spec.partition_type == PartitionType.SKIP and spec.grad_allreduce:
            plan.grad_sum.append(pname)
    if problems:
        raise TensorParallelPlanError(problems)
    for text in plan.warnings:
        warnings.warn(f"AutoTP: {text}", stacklevel=2)
    return plan
