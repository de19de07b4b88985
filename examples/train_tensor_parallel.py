"""Tensor parallelism (AutoTP) with ZeRO: a Hugging Face Llama split by its own tp_plan.

    torchrun --nproc_per_node 4 examples/train_tensor_parallel.py --deepspeed_config examples/configs/zero2_autotp.json

With 4 processes and `"tensor_parallel": {"autotp_size": 2}`, ranks {0, 1} and {2, 3} each hold
half of every split Linear layer and compute the same samples; ranks {0, 2} and {1, 3} are the
data-parallel replicas, and ZeRO shards each rank's pieces over them. The engine's data loader
(`training_data=`) gives both ranks of a tensor group the same batch; the first forward checks
that they got it. `tiny_llama` is also what `zeroshard explain ... --model
examples.train_tensor_parallel:tiny_llama` builds (docs/tensor-parallel.md).
"""

import argparse

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import zeroshard as deepspeed


def tiny_llama() -> LlamaForCausalLM:
    """A small Llama with grouped-query attention (8 query heads, 4 key-value heads)."""
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=64)
    return LlamaForCausalLM(config)


class CountingTokens(torch.utils.data.Dataset):
    """Sequences that count up from a random start: the next token is learnable."""

    def __init__(self, n: int = 64, length: int = 32) -> None:
        starts = torch.randint(0, 256, (n, 1), generator=torch.Generator().manual_seed(0))
        self.ids = (starts + torch.arange(length)) % 256

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.ids[i]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--deepspeed_config", required=True)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--local_rank", type=int, default=0)
    args = parser.parse_args()

    deepspeed.init_distributed()
    torch.manual_seed(0)
    model = tiny_llama()
    engine, _, loader, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters(),
                                                training_data=CountingTokens())
    print(f"rank {engine.global_rank}: tensor parallel {engine.mp_world_size} x data parallel {engine.dp_world_size}, "
          f"{sum(p.numel() for p in engine.module.parameters()):,} parameters here")
    while engine.global_steps < args.steps:
        for ids in loader:
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            print(f"rank {engine.global_rank} step {engine.global_steps} loss {loss.item():.4f} "
                  f"grad_norm {engine.get_global_grad_norm():.4f}")
            if engine.global_steps >= args.steps:
                break


if __name__ == "__main__":
    main()
