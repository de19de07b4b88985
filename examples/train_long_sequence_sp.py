"""Train a Hugging Face Llama on long sequences with Ulysses sequence parallelism (ALST).

    torchrun --standalone --nproc_per_node 2 examples/train_long_sequence_sp.py --seq-length 4096 --steps 5

Each rank holds 1/P of every sequence (P = --sp, default: every rank): attention exchanges heads
for sequence with two all-to-alls per layer, the MLP and the loss are tiled along the sequence,
and the loss is the mean over the sequence group's counted tokens. The model is built from a
config (no download); pass --model PATH to load a local checkpoint's config instead.
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

import zeroshard
from zeroshard.runtime.sequence_parallel.ulysses_sp import (
    TiledMLP,
    UlyssesSPAttentionHF,
    UlyssesSPDataLoaderAdapter,
)
from zeroshard.sequence.loss import token_weighted_loss


class RandomDocuments(Dataset):
    """Random token sequences; the first tenth of each is a prompt that is not trained on."""

    def __init__(self, n: int, seq_length: int, vocab: int) -> None:
        self.n, self.seq_length, self.vocab = n, seq_length, vocab

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, self.vocab, (self.seq_length,), generator=torch.Generator().manual_seed(i))
        labels = ids.clone()
        labels[: self.seq_length // 10] = -100
        return {"input_ids": ids, "labels": labels}


def tiled_mlp_forward(self, x):
    """LlamaMLP.forward, tiled along the sequence (one hidden-size-long tile at a time)."""
    shards = max(1, math.ceil(x.shape[-2] / x.shape[-1]))

    def mlp(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))

    return TiledMLP.apply(mlp, self, x, shards, [self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None, help="a local model directory (its config is used)")
    parser.add_argument("--seq-length", type=int, default=4096)
    parser.add_argument("--sp", type=int, default=None, help="sequence-parallel size (default: world size)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--zero-stage", type=int, default=3)
    args = parser.parse_args()

    zeroshard.init_distributed()
    sp = args.sp or dist.get_world_size()
    from transformers import AutoConfig, LlamaConfig, LlamaForCausalLM
    from transformers.models.llama import modeling_llama

    modeling_llama.LlamaMLP.forward = tiled_mlp_forward  # before the model runs
    if args.model:
        config = AutoConfig.from_pretrained(args.model, attn_implementation="sdpa")
    else:
        config = LlamaConfig(hidden_size=256, num_attention_heads=8, num_key_value_heads=4, num_hidden_layers=4,
                             intermediate_size=688, vocab_size=1024, max_position_embeddings=args.seq_length,
                             attn_implementation="sdpa")
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)

    mpu = UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", sp, micro_batch_size=1)
    ds_config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "weight_decay": 0.0}},
        "zero_optimization": {"stage": args.zero_stage},
        "gradient_clipping": 1.0,
        "steps_per_print": 1000,
    }
    engine, *_ = zeroshard.initialize(model=model, config=ds_config, mpu=mpu)
    group = engine.seq_parallel_group
    loader = DataLoader(RandomDocuments(64, args.seq_length, config.vocab_size), batch_size=1)
    loader = UlyssesSPDataLoaderAdapter(loader, mpu.get_sequence_parallel_rank(), group,
                                        mpu.get_sequence_parallel_world_size(), engine.device)

    for step, batch in zip(range(1, args.steps + 1), loader, strict=False):
        shift_labels = batch.pop("shift_labels")
        logits = engine(**batch).logits  # [1, seq/P, vocab]: this rank's slice only
        loss_sum = torch.nn.functional.cross_entropy(
            logits.float().flatten(0, 1), shift_labels.flatten(), ignore_index=-100, reduction="sum"
        )
        loss = token_weighted_loss(loss_sum, (shift_labels != -100).sum(), group)
        engine.backward(loss)
        engine.step()
        if dist.get_rank() == 0:
            peak = torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else float("nan")
            print(f"step {step} loss {loss.item():.4f} seq {args.seq_length} sp {sp} peak_mib {peak:.0f}", flush=True)
    UlyssesSPAttentionHF.unregister_from_transformers()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
