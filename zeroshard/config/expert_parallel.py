"""``expert_parallel``: AutoEP, DeepSpeed's section that swaps the MoE blocks of a Hugging Face
model for expert-parallel layers (zeroshard/module_inject, docs/moe.md).

Routing keys left out (None, or DeepSpeed's ``"auto"``) are filled from the model's own config
when the layers are swapped (``zeroshard.module_inject.auto_ep_presets.resolve_routing``); a
value written here wins over the model's. ``zeroshard explain`` and the engine's log say
which value came from where.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator

from zeroshard.config.base import JsonInt, _equals, _Section, _Unsupported
from zeroshard.config.choices import AUTOEP_PRESETS

__all__ = ["ExpertParallelConfig"]



class ExpertParallelConfig(_Section):
    """``expert_parallel`` (AutoEP).

    Attributes:
        enabled: swap the model's MoE blocks at ``initialize``.
        autoep_size: ranks each layer's experts are spread over (consecutive ranks; must divide
            the world size and every layer's number of experts).
        preset_model: "mixtral", "qwen3_moe" (also Qwen2-MoE), "deepseek_v2", "deepseek_v3";
            None: chosen from ``config.model_type``.
        moe_layer_pattern: regular expression matched (fully) against module names; None: the
            preset's (``model\\.layers\\.\\d+\\.mlp``).
        expert_pattern / router_pattern: the MoE block's child holding the experts / the router.
        expert_w1 / expert_w2 / expert_w3: the experts' weight names (w3 None: w1 is the fused
            gate-and-up projection, split in two).
        num_experts_attr / top_k_attr: the model config's attribute names for them.
        has_shared_experts / shared_experts_pattern / shared_experts_gate_pattern: dense
            shared experts (and their sigmoid gate) kept beside the routed ones.
        route_norm: renormalise the top-k weights to sum to 1 (None: the model's
            ``norm_topk_prob``, else the preset's).
        route_scale: factor on the routing weights (None: the model's
            ``routed_scaling_factor``, else 1.0).
        routed_scaling_factor: DeepSpeed's other way to give ``route_scale`` ("auto": from
            the model).
        score_func: "softmax", "sigmoid" or "auto" (the preset's).
        top_k: experts per token, or "auto" (the model's ``num_experts_per_tok``).
        num_expert_groups / num_limited_groups: group-limited selection (DeepSeek's
            ``n_group`` / ``topk_group``; None: the model's).
        load_balance_coeff: auxiliary-loss-free load balancing (torchtitan's key): at each
            optimizer step the routers' selection bias moves by
            ``coeff * sign(mean count - count)``, centred. None: off. Not in DeepSpeed 0.19,
            which refuses any value but null.
        use_grouped_mm: True: the experts run as one grouped computation (torch._grouped_mm on
            CUDA bf16 at compute capability 9.0+, else one padded bmm while the padding is small,
            else the loop); False: one matmul per expert (zeroshard/moe/autoep/expert_paths.py).
        disable_triton_grouped_mm: DeepSpeed's switch from its Triton kernel to
            torch._grouped_mm on GPUs below 9.0. There is no Triton kernel here: True uses
            torch._grouped_mm wherever torch runs it for the device and dtype (CPU, older GPUs),
            not only where it is the fast kernel. Only with use_grouped_mm.
        combine_impl: how each token's k expert outputs are summed with their weights:
            "auto" / "weighted_sum" elementwise; "legacy_bmm" DeepSpeed's fp32 batched matmul.
    """

    enabled: bool = False
    autoep_size: JsonInt = Field(1, ge=1)
    preset_model: str | None = None
    moe_layer_pattern: str | None = None
    expert_pattern: str | None = None
    router_pattern: str | None = None
    expert_w1: str | None = None
    expert_w2: str | None = None
    expert_w3: str | None = None
    num_experts_attr: str | None = None
    top_k_attr: str | None = None
    has_shared_experts: bool | None = None
    shared_experts_pattern: str | None = None
    shared_experts_gate_pattern: str | None = None
    route_norm: bool | None = None
    route_scale: float | None = Field(None, gt=0)
    routed_scaling_factor: float | Literal["auto"] = "auto"
    score_func: Literal["auto", "softmax", "sigmoid"] = "auto"
    top_k: JsonInt | Literal["auto"] = "auto"
    num_expert_groups: JsonInt | None = Field(None, ge=1)
    num_limited_groups: JsonInt | None = Field(None, ge=1)
    load_balance_coeff: float | None = Field(None, gt=0)
    use_grouped_mm: bool = True
    disable_triton_grouped_mm: bool = False
    combine_impl: Literal["auto", "weighted_sum", "legacy_bmm"] = "auto"
    # Accepted, no effect: there is no AutoTP folding here to validate.
    validate_folding_routing: bool = False

    NO_EFFECT: ClassVar[frozenset[str]] = frozenset({"validate_folding_routing"})
    UNLISTED_DEFAULTS: ClassVar[frozenset[str]] = frozenset(
        {
            "preset_model", "moe_layer_pattern", "expert_pattern", "router_pattern", "expert_w1", "expert_w2",
            "expert_w3", "num_experts_attr", "top_k_attr", "has_shared_experts", "shared_experts_pattern",
            "shared_experts_gate_pattern", "route_norm", "route_scale", "routed_scaling_factor", "score_func",
            "top_k", "num_expert_groups", "num_limited_groups",
        }
    )
    NOT_SUPPORTED: ClassVar[dict[str, _Unsupported]] = {
        "expert_tensor_parallel_size": _Unsupported(
            _equals(1), "Expert tensor parallelism is not supported (no tensor parallelism); remove it or set 1."
        ),
        "score_apply": _Unsupported(
            lambda v: v in ("auto", "post"),
            "Routing weights are applied to the experts' outputs (\"post\"); remove it or set \"post\".",
        ),
    }

    @field_validator("top_k")
    @classmethod
    def _positive_top_k(cls, value: Any) -> Any:
        if isinstance(value, int) and value < 1:
            raise ValueError('must be a positive integer or "auto". Write the number of experts per token')
        return value

    @field_validator("routed_scaling_factor")
    @classmethod
    def _positive_scale(cls, value: Any) -> Any:
        if isinstance(value, float) and value <= 0:
            raise ValueError('must be a positive number or "auto". Write the model\'s routed scaling factor')
        return value

    @field_validator("preset_model")
    @classmethod
    def _known_preset(cls, value: str | None) -> str | None:
        if value is not None and value not in AUTOEP_PRESETS:
            raise ValueError(f"unknown preset. Use one of {', '.join(AUTOEP_PRESETS)}, or leave it out to detect it")
        return value
