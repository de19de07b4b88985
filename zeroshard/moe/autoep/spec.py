"""DeepSpeed's AutoEP descriptions of a layer: `MoELayerSpec` (what the detection found in one
MoE block) and `AutoEPConfig` (the `expert_parallel` section as a dataclass), with
`fill_autoep_config_from_hf`, in DeepSpeed's field names (its
`deepspeed.module_inject.auto_ep_config`).

They are adapters: `routing_from_spec` turns a spec and a config into zeroshard's
`RoutingSettings`, which the one AutoEP layer (zeroshard/moe/autoep/layer.py) is built from.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Literal

from zeroshard.moe.autoep.presets import PRESETS, MoEPreset, RoutingSettings

__all__ = ["AutoEPConfig", "MoELayerSpec", "fill_autoep_config_from_hf", "routing_from_spec"]

# DeepSpeed's "key absent" marker for expert_w3 (None there means gate and up fused).
_UNSET = object()


@dataclass
class MoELayerSpec:
    """One detected MoE block, DeepSpeed's fields (`e_score_correction_bias_path`: where the
    selection bias lives, None on the router, "" on the block, else a submodule path)."""

    moe_module_name: str
    model_family: str
    router_name: str
    experts_name: str
    expert_storage: Literal["fused_3d", "module_list"]
    expert_w1_name: str
    expert_w2_name: str
    expert_w3_name: str | None
    num_experts: int
    top_k: int
    hidden_size: int
    ffn_hidden_size: int
    score_func: Literal["softmax", "sigmoid"]
    score_apply: Literal["pre", "post"]
    route_norm: bool
    gate_bias: bool
    return_router_logits: bool
    router_logits_capture_target: Literal["moe_block", "router", "none"]
    router_logits_capture_index: int | None
    router_logits_capture_layer_name: str | None
    has_shared_experts: bool
    shared_experts_name: str
    shared_experts_gate_name: str = ""
    route_scale: float = 1.0
    num_expert_groups: int | None = None
    num_limited_groups: int | None = None
    group_score_func: Literal["max", "top2_sum"] = "top2_sum"
    supports_expert_bias: bool = True
    unsupported_router_bias_names: tuple[str, ...] = ()
    preset_adapter: str = "default"
    router_logits_capture_mode: Literal["raw", "post_score"] = "post_score"
    moe_output_shape: Literal["batched", "flat"] = "batched"
    e_score_correction_bias_path: str | None = None
    expert_activation: str = "swiglu"
    expert_activation_alpha: float = 1.702
    expert_activation_limit: float = 7.0


@dataclass
class AutoEPConfig:
    """The `expert_parallel` section, DeepSpeed's fields and defaults."""

    enabled: bool = False
    autoep_size: int = 1
    expert_tensor_parallel_size: int = 1
    validate_folding_routing: bool = False
    async_split_plan: bool = False
    preset_model: str | None = None
    moe_layer_pattern: str | None = None
    expert_pattern: str | None = None
    router_pattern: str | None = None
    use_grouped_mm: bool = True
    disable_triton_grouped_mm: bool = False
    route_norm: bool | None = None
    route_scale: float = 1.0
    score_apply: Literal["auto", "pre", "post"] = "auto"
    combine_impl: Literal["auto", "weighted_sum", "fused_weighted_sum", "legacy_bmm"] = "auto"
    row_weighting_impl: Literal["auto", "eager", "fused"] = "auto"
    gate_up_impl: Literal["separate", "fused"] = "separate"
    comm_backend: Literal["comm", "deepep"] = "comm"
    comm_num_sm: int = 12
    comm_qp_margin: int = 4
    comm_max_tokens_per_rank: int = 0
    num_expert_groups: int | None = None
    num_limited_groups: int | None = None
    score_func: Literal["auto", "softmax", "sigmoid"] = "auto"
    top_k: int | str = "auto"
    load_balance_coeff: float | None = None
    routed_scaling_factor: float | str = "auto"
    expert_w1: str | None = None
    expert_w2: str | None = None
    expert_w3: Any = _UNSET
    num_experts_attr: str | None = None
    top_k_attr: str | None = None
    has_shared_experts: bool | None = None
    shared_experts_pattern: str | None = None
    shared_experts_gate_pattern: str | None = None
    expert_activation: str | None = None
    _load_balance_coeff_explicit: bool = field(default=False, init=False, repr=False)


def fill_autoep_config_from_hf(config: AutoEPConfig, model_config: Any) -> None:
    """Fill the group and scale settings the user left unset from the Hugging Face config
    (`n_group`, `topk_group`, `routed_scaling_factor`), in place."""
    if model_config is None:
        return
    if config.num_expert_groups is None:
        config.num_expert_groups = getattr(model_config, "n_group", None)
    if config.num_limited_groups is None:
        config.num_limited_groups = getattr(model_config, "topk_group", None)
    if config.routed_scaling_factor == "auto":
        scale = getattr(model_config, "routed_scaling_factor", None)
        if scale is not None:
            config.route_scale = float(scale)


def routing_from_spec(spec: MoELayerSpec, config: AutoEPConfig | None) -> RoutingSettings:
    """zeroshard's routing settings for a layer DeepSpeed's way: the spec's values, the
    config's `route_norm` over the spec's. A known family keeps its preset's numerics (the
    logits' and weights' dtypes).

    Raises:
        ValueError: a setting zeroshard's layer does not compute (`score_apply="pre"`, a gate
            bias); the message names the field and the fix.
    """
    config = config if config is not None else AutoEPConfig()
    score_apply = spec.score_apply if config.score_apply == "auto" else config.score_apply
    if score_apply != "post":
        raise ValueError(
            f"MoELayerSpec.score_apply={score_apply!r} ({spec.moe_module_name}): zeroshard's AutoEP applies the "
            'routing weights after the experts only. Set score_apply="post".'
        )
    if spec.gate_bias:
        raise ValueError(
            f"MoELayerSpec.gate_bias=True ({spec.moe_module_name}): zeroshard's AutoEP router has no bias on its gate "
            "projection. Set gate_bias=False, or leave expert_parallel off for this model."
        )
    base = PRESETS.get(spec.model_family) or MoEPreset((), "num_local_experts", spec.score_func, spec.route_norm)
    preset = replace(
        base, router_pattern=spec.router_name, experts_pattern=spec.experts_name, expert_w1=spec.expert_w1_name,
        expert_w2=spec.expert_w2_name, expert_w3=spec.expert_w3_name,
        expert_modules=spec.expert_storage == "module_list",
        shared_experts_pattern=(spec.shared_experts_name or None) if spec.has_shared_experts else None,
        shared_experts_gate_pattern=spec.shared_experts_gate_name or None,
        group_score=spec.group_score_func, selection_bias="e_score_correction_bias",
        selection_bias_path=spec.e_score_correction_bias_path,
    )
    route_norm = spec.route_norm if config.route_norm is None else config.route_norm
    groups, limited = spec.num_expert_groups, spec.num_limited_groups
    if groups == 1 and limited in (None, 1):
        groups = limited = None
    sources = {key: "MoELayerSpec" for key in (
        "preset_model", "num_experts", "top_k", "score_func", "route_scale", "num_expert_groups", "num_limited_groups")}
    sources["route_norm"] = "MoELayerSpec" if config.route_norm is None else "AutoEPConfig"
    return RoutingSettings(
        spec.model_family if spec.model_family in PRESETS else None, preset, int(spec.num_experts), int(spec.top_k),
        spec.score_func, bool(route_norm), float(spec.route_scale), groups, limited, sources,
    )
