"""Rank-side scenarios for tests/dist/moe/test_autoep.py: tiny Hugging Face MoE models (Mixtral,
Qwen3-MoE, DeepSeek-V3) built from a config, swapped by AutoEP, against the unswapped model.

Every rank builds the same weights (seeded), so the unswapped model on this rank's batch is an
independent reference: the swapped model must give the same logits, router logits, auxiliary
loss and expert choices; and training must not depend on autoep_size.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import zeroshard
from zeroshard.config.expert_parallel import ExpertParallelConfig
from zeroshard.module_inject.auto_ep import autoep_layers, replace_moe_layers
from zeroshard.moe.utils import attach_expert_groups

KINDS = ("mixtral", "qwen3_moe", "deepseek_v3")
MORE_KINDS = ("qwen2_moe", "deepseek_v2")  # forward equality only
VOCAB, SEQ = 48, 6
GA, STEPS = 2, 2


def build_hf(kind: str) -> nn.Module:
    """A 2-layer model with 4 (8 for DeepSeek-V3) experts; routers and DeepSeek's selection
    bias drawn large and non-zero so that routing is far from uniform and the bias matters."""
    from transformers import (
        DeepseekV3Config,
        DeepseekV3ForCausalLM,
        MixtralConfig,
        MixtralForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=2, max_position_embeddings=32, attn_implementation="eager")
    if kind == "mixtral":
        model = MixtralForCausalLM(MixtralConfig(**common, intermediate_size=12, num_local_experts=4,
                                                 num_experts_per_tok=2, output_router_logits=True))
    elif kind == "qwen3_moe":
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**common, intermediate_size=12, moe_intermediate_size=12,
                                                   num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
                                                   head_dim=8, output_router_logits=True))
    elif kind == "qwen2_moe":
        from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

        model = Qwen2MoeForCausalLM(Qwen2MoeConfig(
            **common, intermediate_size=12, moe_intermediate_size=12, shared_expert_intermediate_size=12,
            num_experts=4, num_experts_per_tok=2, norm_topk_prob=False, output_router_logits=True))
    elif kind == "deepseek_v2":
        from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

        model = DeepseekV2ForCausalLM(DeepseekV2Config(
            **common, intermediate_size=12, moe_intermediate_size=8, n_routed_experts=8, num_experts_per_tok=2,
            n_group=4, topk_group=2, topk_method="group_limited_greedy", routed_scaling_factor=1.7,
            first_k_dense_replace=1, n_shared_experts=1, q_lora_rank=None, kv_lora_rank=8, qk_rope_head_dim=4,
            qk_nope_head_dim=4, v_head_dim=8))
    else:
        model = DeepseekV3ForCausalLM(DeepseekV3Config(
            **common, intermediate_size=12, moe_intermediate_size=8, n_routed_experts=8, num_experts_per_tok=2,
            n_group=4, topk_group=2, routed_scaling_factor=2.446, first_k_dense_replace=1, n_shared_experts=1,
            q_lora_rank=None, kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8,
            norm_topk_prob=True))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape) * 0.3)
    return model


def batch(rank: int, step: int = 0, micro: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + 100 * step + 10 * micro + rank)
    return torch.randint(0, VOCAB, (2, SEQ), generator=g)


def _capture_choices(model: nn.Module, index: int) -> list[torch.Tensor]:
    """Each router's chosen experts [T, k] (sorted per token) in forward order."""
    seen: list[torch.Tensor] = []
    for name, module in model.named_modules():
        if name.endswith("mlp.gate") or name.endswith("mlp.router"):
            module.register_forward_hook(lambda m, a, out: seen.append(out[index].sort(dim=-1).values))
    return seen


def forward_cases(cases: list[tuple[str, int]]) -> list[dict[str, Any]]:
    """Per (kind, autoep_size): the swapped model's largest differences from the unswapped one."""
    rank = dist.get_rank()
    results = []
    for kind, autoep_size in cases:
        reference = build_hf(kind).eval()
        swapped = copy.deepcopy(reference)
        replace_moe_layers(swapped, ExpertParallelConfig(enabled=True, autoep_size=autoep_size))
        attach_expert_groups(swapped)
        ref_choices, my_choices = _capture_choices(reference, 2), _capture_choices(swapped, 2)
        x = batch(rank)
        with torch.no_grad():
            a = reference(x, output_router_logits=True)
            b = swapped(x, output_router_logits=True)
        layers = autoep_layers(swapped)
        out = {
            "logits": (a.logits - b.logits).abs().max().item(),
            "router_logits": max((ra - rb).abs().max().item() for ra, rb in zip(a.router_logits, b.router_logits,
                                                                                 strict=True)),
            "num_router_logits": (len(a.router_logits), len(b.router_logits)),
            "aux": None if a.aux_loss is None else abs(a.aux_loss.item() - b.aux_loss.item()),
            "choices_equal": len(ref_choices) == len(my_choices) > 0 and all(
                torch.equal(r, m) for r, m in zip(ref_choices, my_choices, strict=True)),
            "local_experts": [tuple(layer.experts.w1.shape) for _, layer in layers],
            "logit_scale": a.logits.abs().max().item(),
        }
        if kind == "deepseek_v3":
            layer = layers[0][1]
            # The bias matters: without it, some token picks other experts.
            with torch.no_grad():
                h = torch.randn(64, 16, generator=torch.Generator().manual_seed(rank))
                with_bias = layer.router(h)[2].sort(-1).values
                saved = layer.router.e_score_correction_bias.clone()
                layer.router.e_score_correction_bias.zero_()
                without = layer.router(h)[2].sort(-1).values
                layer.router.e_score_correction_bias.copy_(saved)
            out["bias_changes_choice"] = not torch.equal(with_bias, without)
            out["route_scale"] = layer.router.route_scale
        results.append(out)
    return results


def engine_config(autoep_size: int, stage: int, mode: str, optimizer: str = "AdamW") -> dict[str, Any]:
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": GA,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0}},
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "expert_parallel": {"enabled": True, "autoep_size": autoep_size},
        "steps_per_print": 1000,
    }
    if optimizer == "Muon":
        config["optimizer"] = {"type": "Muon", "params": {
            "lr": 1e-2, "muon_exclude_patterns": ["embed", "lm_head", "router"]}}
    if mode == "bf16":
        config["bf16"] = {"enabled": True}
    return config


def by_global_name(engine, read) -> dict[str, torch.Tensor]:
    """`read(p)` for every parameter (collective), stacked experts split into global experts."""
    out: dict[str, torch.Tensor] = {}
    for name, p in engine.module.named_parameters():
        value = read(p)
        if getattr(p, "allreduce", True) is False:
            layer = engine.module.get_submodule(name.rsplit(".experts.", 1)[0])
            for j, row in enumerate(value):
                out[f"{name}[{layer.global_expert_index(j)}]"] = row
        else:
            out[name] = value
    return out


def train_cases(cases: list[tuple[str, int, int, str]]) -> list[dict[str, Any]]:
    """(kind, autoep_size, stage, mode): losses, norms and fp32 masters after each of 2 steps
    (accumulation 2)."""
    rank = dist.get_rank()
    results = []
    for kind, autoep_size, stage, mode in cases:
        config = engine_config(autoep_size, stage, mode)
        with zeroshard.zero.Init(config_dict_or_path=config, enabled=stage == 3):  # DeepSpeed's stage-3 idiom
            model = build_hf(kind)
        engine, _, _, _ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=config)
        out: dict[str, Any] = {"losses": [], "norms": [], "masters": []}
        for step in range(STEPS):
            for micro in range(GA):
                x = batch(rank, step, micro)
                loss = engine(input_ids=x, labels=x).loss
                engine.backward(loss)
                out["losses"].append(loss.item())
                engine.step()
            out["norms"].append(engine.get_global_grad_norm())
            out["masters"].append(by_global_name(engine, zeroshard.safe_get_full_fp32_param))
        results.append(out)
    return results


COEFF = 1e-3


def balance_case(autoep_size: int, stage: int) -> dict[str, Any]:
    """One optimizer step (accumulation 2) of DeepSeek-V3 with load_balance_coeff: the selection
    bias before and after, and the routes per expert this rank's tokens took in the unswapped
    model (the independent count the update must use)."""
    rank = dist.get_rank()
    model = build_hf("deepseek_v3")
    reference = copy.deepcopy(model)
    counts = torch.zeros(8)

    def count(module, args, out) -> None:
        counts.add_(torch.bincount(out[2].reshape(-1), minlength=8).float())

    reference.model.layers[1].mlp.gate.register_forward_hook(count)
    config = engine_config(autoep_size, stage, "fp32")
    config["expert_parallel"]["load_balance_coeff"] = COEFF
    engine, _, _, _ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=config)
    layer = autoep_layers(engine.module)[0][1]
    before = layer.router.e_score_correction_bias.detach().clone()
    for micro in range(GA):
        x = batch(rank, 0, micro)
        with torch.no_grad():
            reference(input_ids=x, labels=x)
        engine.backward(engine(input_ids=x, labels=x).loss)
        engine.step()
    after = layer.router.e_score_correction_bias.detach().clone()
    return {"before": before, "after": after, "counts": counts, "pending": layer.tokens_per_expert}


def save_case(kind: str, autoep_size: int, stage: int, root: str, optimizer: str = "AdamW") -> dict[str, Any]:
    """One optimizer step, then save_16bit_model, save_checkpoint; the masters (global names)."""
    rank = dist.get_rank()
    model = build_hf(kind)
    engine, _, _, _ = zeroshard.initialize(
        model=model, model_parameters=model.parameters(), config=engine_config(autoep_size, stage, "fp32", optimizer))
    for micro in range(GA):
        x = batch(rank, 0, micro)
        engine.backward(engine(input_ids=x, labels=x).loss)
        engine.step()
    masters = by_global_name(engine, zeroshard.safe_get_full_fp32_param)
    exp_avg = by_global_name(engine, lambda p: zeroshard.safe_get_full_optimizer_state(p, "exp_avg")) if (
        optimizer == "AdamW") else {}
    engine.save_16bit_model(root, f"{kind}-{autoep_size}-{stage}-{optimizer}.safetensors")
    engine.save_checkpoint(f"{root}/ckpt-{kind}-{autoep_size}-{stage}-{optimizer}", tag="t")
    return {"masters": masters, "exp_avg": exp_avg}


def load_case(kind: str, autoep_size: int, stage: int, ckpt: str, optimizer: str = "AdamW") -> dict[str, Any]:
    """A fresh engine at `autoep_size` loading `ckpt`: its masters and AdamW's exp_avg (global names)."""
    model = build_hf(kind)
    engine, _, _, _ = zeroshard.initialize(
        model=model, model_parameters=model.parameters(), config=engine_config(autoep_size, stage, "fp32", optimizer))
    engine.load_checkpoint(ckpt, tag="t")
    exp_avg = by_global_name(engine, lambda p: zeroshard.safe_get_full_optimizer_state(p, "exp_avg")) if (
        optimizer == "AdamW") else {}
    return {"masters": by_global_name(engine, zeroshard.safe_get_full_fp32_param), "exp_avg": exp_avg}
