"""Rank-side scenarios for tests/dist/optim/test_qk_clip.py: MuonClip on tiny Hugging Face
models (Llama with grouped-query attention, DeepSeek-V3 with MLA) built from configs, their
query and key weights scaled up so that logits exceed the threshold from the first step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

import zeroshard

VOCAB, SEQ, MICRO = 32, 8, 2
TAU, ALPHA = 3.0, 0.5
PUSH = 12.0  # query and key weights x PUSH: first-step logits ~4-9, over TAU in most heads
HP = {"muon_lr": 0.02, "adam_lr": 0.01, "momentum": 0.9, "weight_decay": 0.1, "betas": (0.9, 0.95), "eps": 1e-8}


def llama(attn: str = "sdpa"):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                         attn_implementation=attn)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(PUSH)
            layer.self_attn.k_proj.weight.mul_(PUSH)
    return model


def deepseek(attn: str = "sdpa"):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(0)
    config = DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
        topk_group=1, n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16,
        qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8, max_position_embeddings=SEQ, attn_implementation=attn,
        experts_implementation="eager",  # grouped_mm has no float64 (the reference)
    )
    model = DeepseekV3ForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_b_proj.weight.mul_(1.25 * PUSH)  # first layer: heads on both sides of TAU
            layer.self_attn.kv_b_proj.weight.mul_(1.25 * PUSH)
            layer.self_attn.kv_a_proj_with_mqa.weight.mul_(2.0)  # the shared rotary key too
    return model


MODELS = {"llama": llama, "deepseek": deepseek}


def batches(world: int, steps: int, ga: int) -> list[list[list[torch.Tensor]]]:
    """[step][rank][micro] -> token ids [MICRO, SEQ]."""
    g = torch.Generator().manual_seed(7)
    return [[[torch.randint(0, VOCAB, (MICRO, SEQ), generator=g) for _ in range(ga)] for _ in range(world)]
            for _ in range(steps)]


@dataclass(frozen=True)
class ClipCase:
    model: str = "llama"
    stage: int = 2
    ga: int = 2
    steps: int = 2
    offload: bool = False
    bf16: bool = False
    clip: float = 0.0
    muon_lr: float = HP["muon_lr"]
    adam_lr: float = HP["adam_lr"]
    attn: str = "sdpa"

    @property
    def label(self) -> str:
        return (f"{self.model}-{self.attn}-stage{self.stage}-ga{self.ga}" + ("-offload" if self.offload else "")
                + ("-bf16" if self.bf16 else "") + (f"-clip{self.clip}" if self.clip else "")
                + ("-lr0" if self.muon_lr == self.adam_lr == 0 else ""))


def config_of(case: ClipCase) -> dict[str, Any]:
    params = {**HP, "betas": list(HP["betas"]), "muon_lr": case.muon_lr, "adam_lr": case.adam_lr,
              "qk_clip": {"enabled": True, "threshold": TAU, "alpha": ALPHA}}
    zero: dict[str, Any] = {"stage": case.stage, "stage3_param_persistence_threshold": 0}
    if case.offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    config = {
        "train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": case.ga,
        "gradient_clipping": case.clip, "optimizer": {"type": "Muon", "params": params},
        "zero_optimization": zero, "steps_per_print": 1000,
    }
    if case.bf16:
        config["bf16"] = {"enabled": True}
    return config


def train_cases(cases: list[ClipCase]) -> list[dict[str, Any]]:
    """Per case, after each step: every parameter's full fp32 master by name and the
    engine's reduced S_max (every head, module order)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    results = []
    for case in cases:
        model = MODELS[case.model](case.attn)
        engine, *_ = zeroshard.initialize(model=model, config=config_of(case))
        data = batches(world, case.steps, case.ga)
        masters, s_max = [], []
        for step in range(case.steps):
            for micro in range(case.ga):
                ids = data[step][rank][micro]
                engine.backward(engine(input_ids=ids, labels=ids).loss)
                engine.step()
            s_max.append(engine.qk_clip.last_max.clone())
            masters.append({n: zeroshard.safe_get_full_fp32_param(p) for n, p in engine.module.named_parameters()})
        published = None
        if case.stage < 3:  # the module's own (bf16) query weight after the last step
            published = engine.module.model.layers[0].self_attn.get_parameter(
                "q_proj.weight" if case.model == "llama" else "q_b_proj.weight").detach().clone()
        results.append({"masters": masters, "s_max": s_max, "modules": list(engine.qk_clip.names),
                        "published": published})
    return results
