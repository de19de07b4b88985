"""A DeepSpeed-style training loop, unchanged, on zeroshard.

    torchrun --nproc_per_node 2 examples/train_minimal.py --deepspeed_config examples/configs/zero2_fp32.json

Runs a few optimizer steps of a small regression model on random data and prints the loss,
the global gradient norm and the learning rate. `import zeroshard as deepspeed` is the whole
port: the loop below is the one DeepSpeed's tutorials use.
"""

import argparse

import torch
from torch import nn

import zeroshard as deepspeed


class RandomRegression(torch.utils.data.Dataset):
    def __init__(self, n: int = 512, dim: int = 16) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, dim, generator=g)
        self.y = self.x @ torch.randn(dim, 1, generator=g) + 0.1 * torch.randn(n, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


class Model(nn.Module):
    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[nn.Sequential(nn.Linear(dim, dim), nn.GELU()) for _ in range(3)])
        self.head = nn.Linear(dim, 1)

    def forward(self, x, y):
        return nn.functional.mse_loss(self.head(self.blocks(x)).float(), y.float())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--deepspeed_config", required=True)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--local_rank", type=int, default=0)  # accepted as DeepSpeed's launcher passes it
    args = parser.parse_args()

    deepspeed.init_distributed()
    torch.manual_seed(0)
    model = Model()
    engine, optimizer, loader, scheduler = deepspeed.initialize(
        args=args, model=model, model_parameters=model.parameters(), training_data=RandomRegression()
    )
    epoch = 0
    while engine.global_steps < args.steps:
        loader.sampler.set_epoch(epoch)
        for x, y in loader:
            # The loader pins its batches on CUDA, so these copies do not block the host.
            loss = engine(x.to(engine.device, non_blocking=True), y.to(engine.device, non_blocking=True))
            engine.backward(loss)
            engine.step()
            stepped = engine.micro_steps % engine.gradient_accumulation_steps() == 0
            if stepped and engine.global_rank == 0:
                print(f"step {engine.global_steps:3d}  loss {loss.item():.4f}  "
                      f"grad_norm {engine.get_global_grad_norm():.4f}  lr {engine.get_lr()[0]:.2e}")
            if engine.global_steps >= args.steps:
                break
        epoch += 1
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
