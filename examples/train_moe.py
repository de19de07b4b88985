"""A DeepSpeed MoE training loop on zeroshard: the imports are the whole port.

    torchrun --nproc_per_node 2 examples/train_moe.py --deepspeed_config examples/configs/zero3_fp32.json --ep-size 2

A model with a DeepSpeed `MoE` layer (4 experts, top-2) spread over --ep-size ranks; the
optimizer groups come from `split_params_into_different_moe_groups_for_optimizer`, as
DeepSpeed's MoE tutorial builds them. Prints the loss, the auxiliary loss and the norm.
"""

import argparse

import torch
from torch import nn

import zeroshard as deepspeed
from zeroshard.moe.layer import MoE
from zeroshard.moe.utils import split_params_into_different_moe_groups_for_optimizer


class Model(nn.Module):
    def __init__(self, dim: int, ep_size: int) -> None:
        super().__init__()
        self.embed = nn.Linear(dim, dim)
        expert = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.moe = MoE(hidden_size=dim, expert=expert, num_experts=4, ep_size=ep_size, k=2)
        self.head = nn.Linear(dim, 1)

    def forward(self, x, y):
        hidden, l_aux, _ = self.moe(self.embed(x))
        loss = nn.functional.mse_loss(self.head(hidden).float(), y.float())
        return loss + 0.01 * l_aux, l_aux


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--deepspeed_config", required=True)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--ep-size", type=int, default=2)
    parser.add_argument("--local_rank", type=int, default=0)  # accepted as DeepSpeed's launcher passes it
    args = parser.parse_args()

    deepspeed.init_distributed()
    torch.manual_seed(0)
    model = Model(16, args.ep_size)
    groups = split_params_into_different_moe_groups_for_optimizer(
        {"params": list(model.parameters()), "name": "parameters"}
    )
    engine, _, _, _ = deepspeed.initialize(args=args, model=model, model_parameters=groups)
    g = torch.Generator().manual_seed(engine.global_rank)
    w = torch.randn(16, 1, generator=torch.Generator().manual_seed(0))
    while engine.global_steps < args.steps:
        x = torch.randn(engine.train_micro_batch_size_per_gpu(), 8, 16, generator=g)
        loss, l_aux = engine(x.to(engine.device), (x @ w).to(engine.device))
        engine.backward(loss)
        stepped = engine.is_gradient_accumulation_boundary()
        engine.step()
        if engine.global_rank == 0 and stepped:
            print(
                f"step {engine.global_steps} loss {loss.item():.4f} l_aux {l_aux.item():.4f} "
                f"grad_norm {engine.get_global_grad_norm():.4f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
