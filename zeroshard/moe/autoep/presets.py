"""AutoEP presets: where each Hugging Face MoE family keeps its MoE blocks, and how it routes.

`resolve_routing` merges three sources for each routing setting, in this order of precedence:
the `expert_parallel` config section (what the user wrote), the model's own config
(`n_group`, `topk_group`, `routed_scaling_factor`, `norm_topk_prob`, `num_experts_per_tok`),
and the preset. It returns the values and, for each, where it came from, which `zeroshard
explain` and the engine's log print.

Routing as transformers 5 computes it (reproduced by zeroshard/moe/autoep/layer.py):
- mixtral, qwen3_moe / qwen2_moe: logits in the hidden dtype, softmax in fp32, top-k,
  renormalised when `norm_topk_prob` (always for Mixtral); Qwen casts the weights back to the
  logits' dtype. Qwen2-MoE adds a shared expert scaled by sigmoid(shared_expert_gate(x)).
- deepseek_v2: fp32 logits, softmax, top-k (group-limited by the group's best score when
  `topk_method` is "group_limited_greedy"), times `routed_scaling_factor`; shared experts.
- deepseek_v3 (Moonlight): fp32 logits, sigmoid; `e_score_correction_bias` added for the
  selection only; groups scored by the sum of their two best, `topk_group` of `n_group` kept;
  weights are the unbiased scores, renormalised when `norm_topk_prob`, times
  `routed_scaling_factor`; shared experts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["MoEPreset", "PRESETS", "RoutingSettings", "preset_for_model_type", "resolve_routing"]


@dataclass(frozen=True)
class MoEPreset:
    model_types: tuple[str, ...]
    num_experts_attr: str
    score_func: str  # "softmax" | "sigmoid"
    route_norm: bool  # when the model config has no norm_topk_prob
    moe_layer_pattern: str = r"model\.layers\.\d+\.mlp"
    router_pattern: str = "gate"
    experts_pattern: str = "experts"
    expert_w1: str = "gate_up_proj"
    expert_w2: str = "down_proj"
    expert_w3: str | None = None  # None: expert_w1 is gate and up fused, split in two
    # The experts' layout, detected from the model at the swap (zeroshard/moe/autoep/swap.py):
    # False, stacked [E, ...] tensors on the experts module; True, an nn.ModuleList of one
    # module per expert (remote-code DeepSeek-V3 / Moonlight, transformers 4's Mixtral), whose
    # weights are `<j>.<expert_w1>.<expert_weight_attr>` (None: bare parameters).
    expert_modules: bool = False
    expert_weight_attr: str | None = "weight"
    top_k_attr: str = "num_experts_per_tok"
    shared_experts_pattern: str | None = None
    shared_experts_gate_pattern: str | None = None
    logits_fp32: bool = False  # the router's matmul in fp32 (DeepSeek) or the hidden dtype
    weights_in_logits_dtype: bool = False  # Qwen casts the routing weights back
    group_score: str = "top2_sum"  # how a group of experts is scored for group-limited routing
    read_groups: bool = False  # n_group / topk_group from the model config
    read_route_scale: bool = False  # routed_scaling_factor from the model config
    selection_bias: str | None = None  # the router's buffer added to scores for selection only
    # Where the selection bias lives: None on the router, "" on the block itself, else a
    # submodule path under the block (DeepSpeed's `e_score_correction_bias_path`).
    selection_bias_path: str | None = None


PRESETS: dict[str, MoEPreset] = {
    "mixtral": MoEPreset(("mixtral",), "num_local_experts", "softmax", route_norm=True),
    "qwen3_moe": MoEPreset(
        ("qwen3_moe", "qwen2_moe"), "num_experts", "softmax", route_norm=True, weights_in_logits_dtype=True,
        shared_experts_pattern="shared_expert", shared_experts_gate_pattern="shared_expert_gate",
    ),
    "deepseek_v2": MoEPreset(
        ("deepseek_v2",), "n_routed_experts", "softmax", route_norm=False, shared_experts_pattern="shared_experts",
        logits_fp32=True, group_score="max", read_groups=True, read_route_scale=True,
    ),
    "deepseek_v3": MoEPreset(
        ("deepseek_v3",), "n_routed_experts", "sigmoid", route_norm=False, shared_experts_pattern="shared_experts",
        logits_fp32=True, read_groups=True, read_route_scale=True, selection_bias="e_score_correction_bias",
    ),
}


def preset_for_model_type(model_type: str | None) -> str | None:
    for name, preset in PRESETS.items():
        if model_type in preset.model_types:
            return name
    return None


@dataclass(frozen=True)
class RoutingSettings:
    """What every swapped layer of one model uses; `sources` says where each value came from."""

    preset_name: str | None
    preset: MoEPreset
    num_experts: int
    top_k: int
    score_func: str
    route_norm: bool
    route_scale: float
    num_expert_groups: int | None
    num_limited_groups: int | None
    sources: dict[str, str]

    def explain_lines(self) -> list[str]:
        values = {
            "preset_model": self.preset_name, "num_experts": self.num_experts, "top_k": self.top_k,
            "score_func": self.score_func, "route_norm": self.route_norm, "route_scale": self.route_scale,
            "num_expert_groups": self.num_expert_groups, "num_limited_groups": self.num_limited_groups,
        }
        return [f"expert_parallel.{key} = {values[key]}  ({self.sources[key]})" for key in values]


def _layout(cfg: Any, preset: MoEPreset) -> MoEPreset:
    """The preset with the user's pattern and layout keys put over it."""
    from dataclasses import replace

    overrides = {
        "moe_layer_pattern": cfg.moe_layer_pattern, "router_pattern": cfg.router_pattern,
        "experts_pattern": cfg.expert_pattern, "expert_w1": cfg.expert_w1, "expert_w2": cfg.expert_w2,
        "expert_w3": cfg.expert_w3, "num_experts_attr": cfg.num_experts_attr, "top_k_attr": cfg.top_k_attr,
        "shared_experts_pattern": cfg.shared_experts_pattern,
        "shared_experts_gate_pattern": cfg.shared_experts_gate_pattern,
    }
    overrides = {k: v for k, v in overrides.items() if v is not None}
    if cfg.has_shared_experts is False:
        overrides["shared_experts_pattern"] = None
        overrides["shared_experts_gate_pattern"] = None
    return replace(preset, **overrides)


def resolve_routing(cfg: Any, model_config: Any) -> RoutingSettings:
    """The routing settings for a model, from the `expert_parallel` section `cfg`
    (an ExpertParallelConfig), the Hugging Face `model_config` (or None) and the preset.

    Raises:
        ValueError: no preset given or detected and no `moe_layer_pattern`; a setting that
            is in none of the three places; inconsistent group settings.
    """
    model_type = getattr(model_config, "model_type", None)
    sources: dict[str, str] = {}
    if cfg.preset_model is not None:
        name: str | None = cfg.preset_model
        sources["preset_model"] = "config"
    else:
        name = preset_for_model_type(model_type)
        sources["preset_model"] = f"model config model_type={model_type!r}" if name else "none"
    if name is None and cfg.moe_layer_pattern is None:
        raise ValueError(
            f"expert_parallel.preset_model=null: no preset for model_type={model_type!r}. Set preset_model to "
            f"one of {', '.join(PRESETS)}, or give moe_layer_pattern, expert_pattern and router_pattern."
        )
    base = PRESETS[name] if name else MoEPreset((), "num_local_experts", "softmax", route_norm=True)
    preset = _layout(cfg, base)

    def from_model(attr: str) -> Any:
        return getattr(model_config, attr, None) if model_config is not None else None

    num_experts = from_model(preset.num_experts_attr)
    if num_experts is None:
        raise ValueError(
            f"expert_parallel.num_experts_attr={preset.num_experts_attr!r}: the model config has no such "
            "attribute. Set num_experts_attr to the config attribute holding the number of experts."
        )
    sources["num_experts"] = f"model config {preset.num_experts_attr}"

    if cfg.top_k != "auto":
        top_k, sources["top_k"] = cfg.top_k, "config"
    else:
        top_k = from_model(preset.top_k_attr)
        if top_k is None:
            raise ValueError(
                f'expert_parallel.top_k="auto": the model config has no {preset.top_k_attr}. Set top_k.'
            )
        sources["top_k"] = f"model config {preset.top_k_attr}"

    if cfg.score_func != "auto":
        score_func, sources["score_func"] = cfg.score_func, "config"
    else:
        score_func, sources["score_func"] = preset.score_func, f"preset {name}" if name else "default"

    if cfg.route_norm is not None:
        route_norm, sources["route_norm"] = cfg.route_norm, "config"
    elif from_model("norm_topk_prob") is not None and name != "mixtral" and name != "deepseek_v2":
        route_norm, sources["route_norm"] = bool(from_model("norm_topk_prob")), "model config norm_topk_prob"
    else:
        route_norm, sources["route_norm"] = preset.route_norm, f"preset {name}" if name else "default"

    if cfg.route_scale is not None:
        route_scale, sources["route_scale"] = float(cfg.route_scale), "config"
    elif cfg.routed_scaling_factor != "auto":
        route_scale, sources["route_scale"] = float(cfg.routed_scaling_factor), "config routed_scaling_factor"
    elif preset.read_route_scale and from_model("routed_scaling_factor") is not None:
        route_scale = float(from_model("routed_scaling_factor"))
        sources["route_scale"] = "model config routed_scaling_factor"
    else:
        route_scale, sources["route_scale"] = 1.0, "default"

    groups, limited = cfg.num_expert_groups, cfg.num_limited_groups
    sources["num_expert_groups"] = sources["num_limited_groups"] = "config"
    uses_groups = preset.read_groups and (name != "deepseek_v2" or from_model("topk_method") == "group_limited_greedy")
    if groups is None:
        groups = from_model("n_group") if uses_groups else None
        sources["num_expert_groups"] = "model config n_group" if groups is not None else "default (no groups)"
    if limited is None:
        limited = from_model("topk_group") if uses_groups else None
        sources["num_limited_groups"] = "model config topk_group" if limited is not None else "default (no groups)"
    if groups == 1 and limited in (None, 1):  # one group: every expert is a candidate
        groups = limited = None
    _check_groups(num_experts, top_k, cfg.autoep_size, groups, limited)
    return RoutingSettings(
        name, preset, int(num_experts), int(top_k), score_func, bool(route_norm), route_scale, groups, limited, sources
    )


def _check_groups(num_experts: int, top_k: int, autoep_size: int, groups: int | None, limited: int | None) -> None:
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"expert_parallel.top_k={top_k}: must be between 1 and num_experts ({num_experts}).")
    if num_experts % autoep_size:
        raise ValueError(
            f"expert_parallel.autoep_size={autoep_size}: must divide the number of experts ({num_experts}), "
            "each rank holding num_experts / autoep_size. Pick a divisor of it."
        )
    if (groups is None) != (limited is None):
        raise ValueError(
            f"expert_parallel.num_limited_groups={limited}: num_expert_groups ({groups}) and num_limited_groups "
            "go together. Set both, or neither."
        )
    if groups is not None and limited is not None:
        if num_experts % groups:
            raise ValueError(
                f"expert_parallel.num_expert_groups={groups}: must divide num_experts ({num_experts}). Fix it."
            )
        if limited > groups:
            raise ValueError(
                f"expert_parallel.num_limited_groups={limited}: must be at most num_expert_groups ({groups}). Lower it."
            )
