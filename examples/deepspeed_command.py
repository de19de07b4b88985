"""A DeepSpeed training script, unchanged, started by DeepSpeed's `deepspeed` command.

    zeroshard install-deepspeed-alias
    deepspeed --num_gpus 2 examples/deepspeed_command.py --deepspeed \
        --deepspeed_config examples/configs/zero2_sgd_fp32.json

`import deepspeed` is zeroshard through the alias, which also installs the `deepspeed` command
(docs/launching.md, "DeepSpeed's `deepspeed` command"). The command passes `--local_rank=<n>`
as DeepSpeed's launcher does. Each rank trains a small regression model on its own slice of
every batch and prints its losses (or writes them as JSON into `--out DIR`).
"""

import argparse
import json
import os

import deepspeed
import torch
from torch import nn

DIM = 8


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1, help="passed by the deepspeed launcher")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--out", default=None, help="folder for rank<N>.json (default: print)")
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()

    deepspeed.init_distributed()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh(), nn.Linear(DIM, 1))
    engine, _, _, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters())
    rank, world = engine.global_rank, engine.world_size
    micro = engine.train_micro_batch_size_per_gpu()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(args.steps * world * micro, DIM, generator=g)
    y = x.sum(dim=1, keepdim=True).sin()
    losses = []
    for step in range(args.steps):
        rows = slice((step * world + rank) * micro, (step * world + rank + 1) * micro)  # this rank's slice
        loss = nn.functional.mse_loss(engine(x[rows].to(engine.device)), y[rows].to(engine.device))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    result = {"rank": rank, "world_size": world, "local_rank": args.local_rank, "losses": losses}
    if args.out:
        with open(os.path.join(args.out, f"rank{rank}.json"), "w") as handle:
            json.dump(result, handle)
    else:
        print(json.dumps(result))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
