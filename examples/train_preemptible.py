"""The DeepSpeed-style loop of train_minimal.py, preemptible: a scheduler's signal saves and
exits, the next start resumes (docs/cluster.md).

    torchrun --nproc_per_node 2 examples/train_preemptible.py \
        --deepspeed_config examples/configs/zero2_fp32.json --save-dir ckpt --steps 20

A SIGTERM, SIGUSR1 or SIGUSR2 to any rank: every rank finishes the step it is in, they save one
checkpoint in --save-dir together and exit with status 143 (torchrun's elastic agent restarts
them while --max-restarts lasts; Slurm and Kubernetes: docs/cluster.md). Started again with the
same arguments, on any number of processes, it resumes from the newest complete checkpoint at
the next step and finishes; the last step saves one more checkpoint.

The global batch must not depend on the process count for a resumed run to continue the same
training: the script fixes train_batch_size (24, unless the config sets it) and lets the micro
batch follow the world size; a dataset whose size divides by every batch keeps the steps of an
epoch the same at any world size.
"""

import argparse
import json

import torch
from torch import nn

import zeroshard as deepspeed


class RandomRegression(torch.utils.data.Dataset):
    def __init__(self, n: int = 480, dim: int = 16) -> None:
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


def preemptible(config_path: str, save_dir: str) -> dict:
    """The config file with preemption on, saving to and resuming from save_dir."""
    with open(config_path) as f:
        config = json.load(f)
    for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        config.pop(key, None)  # follow the world size; the global batch stays
    config.setdefault("train_batch_size", 24)
    config["preemption"] = {"enabled": True, "save_dir": save_dir, "resume": True, **config.get("preemption", {})}
    return config


def train(config_path: str, save_dir: str, steps: int) -> None:
    """The training loop, on the process group that exists (or a new one from the environment)."""
    deepspeed.init_distributed()
    torch.manual_seed(0)
    model = Model()
    engine, optimizer, loader, scheduler = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), training_data=RandomRegression(),
        config=preemptible(config_path, save_dir),
    )
    resumed, _ = engine.preemption.resumed
    if resumed and engine.global_rank == 0:
        print(f"resumed from {resumed} at step {engine.global_steps}", flush=True)
    gas = engine.gradient_accumulation_steps()
    steps_per_epoch = len(loader) // gas
    while engine.global_steps < steps:
        # Continue mid-epoch: the sampler's order comes back with the epoch; skip what was trained.
        epoch, done = divmod(engine.global_steps, steps_per_epoch)
        loader.sampler.set_epoch(epoch)
        for i, (x, y) in enumerate(loader):
            if i < done * gas:
                continue
            loss = engine(x.to(engine.device), y.to(engine.device))
            engine.backward(loss)
            if engine.is_gradient_accumulation_boundary() and engine.global_rank == 0:
                print(f"step {engine.global_steps + 1} loss {loss.item():.6f}", flush=True)
            engine.step()  # after a signal: saves with the other ranks, then exits with status 143
            if engine.global_steps >= steps:
                break
    engine.save_checkpoint(save_dir)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--deepspeed_config", required=True)
    parser.add_argument("--save-dir", required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--local_rank", type=int, default=0)  # accepted as DeepSpeed's launcher passes it
    args = parser.parse_args()
    train(args.deepspeed_config, args.save_dir, args.steps)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
