"""AutoEP + Muon + ZeRO-2 on a tiny DeepSeek-V3-style (Moonlight) model built from a config.

    zeroshard launch --nproc 2 examples/autoep_moonlight_tiny.py

`expert_parallel` swaps each MoE block for an expert-parallel layer at `initialize`: each of
the 2 ranks holds 4 of the 8 routed experts, tokens travel by a dropless all-to-all, and the
routing is the model's own (sigmoid scores, the score-correction bias for the choice only,
group-limited selection, routed_scaling_factor 2.446 read from the model config). Muon
orthogonalises each expert's matrix separately; the router stays with AdamW
(`muon_exclude_patterns`). Prints the loss, which falls, and at the end exports the weights
under the Hugging Face names (`save_16bit_model`).
"""

import argparse
import tempfile

import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

import zeroshard

VOCAB, SEQ = 64, 16


def tiny_moonlight() -> DeepseekV3ForCausalLM:
    config = DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
        topk_group=1, routed_scaling_factor=2.446, norm_topk_prob=True, n_shared_experts=1, first_k_dense_replace=1,
        q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
        max_position_embeddings=SEQ,
    )
    return DeepseekV3ForCausalLM(config)


def ds_config(autoep_size: int, load_balance_coeff: float | None) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "Muon", "params": {
            "muon_lr": 0.02, "adam_lr": 3e-3, "muon_exclude_patterns": ["embed", "lm_head", "router"]}},
        "zero_optimization": {"stage": 2},
        "expert_parallel": {"enabled": True, "autoep_size": autoep_size, "preset_model": "deepseek_v3",
                            "load_balance_coeff": load_balance_coeff},
        "steps_per_print": 1000,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--autoep-size", type=int, default=2)
    parser.add_argument("--load-balance-coeff", type=float, default=1e-3)
    parser.add_argument("--local_rank", type=int, default=0)  # accepted as DeepSpeed's launcher passes it
    args = parser.parse_args()

    zeroshard.init_distributed()
    torch.manual_seed(0)
    model = tiny_moonlight()
    engine, _, _, _ = zeroshard.initialize(
        model=model, model_parameters=model.parameters(), config=ds_config(args.autoep_size, args.load_balance_coeff))
    # A small fixed set of sequences per rank: the loss falls as the model learns them.
    g = torch.Generator().manual_seed(100 + engine.global_rank)
    data = torch.randint(0, VOCAB, (8, SEQ), generator=g)
    losses = []
    while engine.global_steps < args.steps:
        rows = torch.randint(0, len(data), (engine.train_micro_batch_size_per_gpu(),), generator=g)
        x = data[rows].to(engine.device)
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        stepped = engine.is_gradient_accumulation_boundary()
        engine.step()
        losses.append(loss.item())
        if engine.global_rank == 0 and stepped:
            print(f"step {engine.global_steps} loss {loss.item():.4f} grad_norm {engine.get_global_grad_norm():.4f}",
                  flush=True)
    with tempfile.TemporaryDirectory() as out:
        path = engine.save_16bit_model(out, "model.safetensors")
        if engine.global_rank == 0:
            from safetensors.torch import load_file

            tiny_moonlight().load_state_dict(load_file(path), strict=True)  # the original HF names
            first, last = sum(losses[:2]) / 2, sum(losses[-2:]) / 2
            print(f"loss fell from {first:.4f} to {last:.4f}; exported weights strict-load into the HF model")


if __name__ == "__main__":
    main()
