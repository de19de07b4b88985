"""MuonClip (QK-clip) on a tiny DeepSeek-V3-style model (multi-head latent attention, AutoEP
experts) with Muon and ZeRO-2, built from a config.

    zeroshard launch --nproc 2 examples/muon_qk_clip.py

The attention up-projections start 40x too large, so the first step's largest pre-softmax
logits are far above the threshold (20 here; Kimi K2 uses 100). After each optimizer step
every head over the threshold gets its query/key weights rescaled (per head: the non-rotary
query and key parts by sqrt(tau / S_max), the rotary query part by tau / S_max), so from the
second step on S_max stays near the threshold. Prints, per step, the loss, the largest S_max
over all heads (reduced over both ranks) and how many heads were clipped.
"""

import argparse

import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

import zeroshard

VOCAB, SEQ, TAU = 64, 16, 20.0


def tiny_model() -> DeepseekV3ForCausalLM:
    config = DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
        topk_group=1, n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, max_position_embeddings=SEQ,
        attn_implementation="sdpa",
    )
    model = DeepseekV3ForCausalLM(config)
    with torch.no_grad():  # an attention that has blown up: logits far over the threshold
        for layer in model.model.layers:
            layer.self_attn.q_b_proj.weight.mul_(40.0)
            layer.self_attn.kv_b_proj.weight.mul_(40.0)
    return model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--local_rank", type=int, default=0)  # accepted as DeepSpeed's launcher passes it
    args = parser.parse_args()

    zeroshard.init_distributed()
    torch.manual_seed(0)
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "Muon", "params": {
            "muon_lr": 0.02, "adam_lr": 3e-3, "muon_exclude_patterns": ["embed", "lm_head", "router"],
            "qk_clip": {"enabled": True, "threshold": TAU, "alpha": 0.5}}},
        "zero_optimization": {"stage": 2},
        "expert_parallel": {"enabled": True, "autoep_size": 2, "preset_model": "deepseek_v3"},
        "steps_per_print": 1000,
    }
    engine, _, _, _ = zeroshard.initialize(model=tiny_model(), config=config)
    g = torch.Generator().manual_seed(100 + engine.global_rank)
    for step in range(1, args.steps + 1):
        for _ in range(config["gradient_accumulation_steps"]):
            ids = torch.randint(0, VOCAB, (4, SEQ), generator=g).to(engine.device)
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
        s_max = engine.qk_clip.last_max  # every head's S_max of this step, before the clip
        if engine.global_rank == 0:
            print(f"step {step} loss {loss.item():.4f} s_max {s_max.max().item():.2f} "
                  f"clipped_heads {int((s_max > TAU).sum())}/{s_max.numel()}", flush=True)


if __name__ == "__main__":
    main()
