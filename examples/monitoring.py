"""Watch a run: DeepSpeed's csv_monitor (and tensorboard, when the package is installed), your
own scalars through engine.monitor.write_events, and engine.metrics() for your own logger.

    python examples/monitoring.py [--out runs/monitoring] [--steps 6]
    torchrun --nproc_per_node 2 examples/monitoring.py      # rank 0 writes, the others do not

Prints the latest figures after each step and, at the end, each file the monitors wrote with
its first lines (docs/monitoring.md describes them).
"""

import argparse
import importlib.util
import os

import torch
from torch import nn

import zeroshard

parser = argparse.ArgumentParser()
parser.add_argument("--out", default="runs/monitoring")
parser.add_argument("--steps", type=int, default=6)
args = parser.parse_args()

config = {
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 2,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 1e-2, "warmup_num_steps": 4}},
    "csv_monitor": {"enabled": True, "output_path": args.out, "job_name": "example"},
    "tensorboard": {
        "enabled": importlib.util.find_spec("tensorboard") is not None,
        "output_path": args.out, "job_name": "example_tb",
    },
}

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
engine, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=config)

for _ in range(args.steps):
    for _ in range(engine.gradient_accumulation_steps()):
        x = torch.randn(4, 8)
        loss = nn.functional.mse_loss(engine(x), x.sum(dim=1, keepdim=True))
        engine.backward(loss)
        engine.step()
    figures = engine.metrics()
    # Your own scalar, indexed by samples like DeepSpeed's events.
    weight_norm = float(model[0].weight.detach().norm())
    engine.monitor.write_events([("Train/Samples/weight_norm", weight_norm, figures["samples"])])
    if engine.global_rank == 0:
        print(f"step {figures['step']} samples {figures['samples']} loss {figures['loss']:.4f} "
              f"lr {figures['lr']:.5f} grad_norm {figures['grad_norm']:.4f}")

engine.destroy()  # flushes and closes the monitors' files (interpreter exit would too)
if engine.global_rank == 0:
    for folder, _, files in sorted(os.walk(args.out)):
        for name in sorted(files):
            path = os.path.join(folder, name)
            print(f"wrote {path}")
            if name.endswith(".csv"):
                with open(path) as handle:
                    for line in handle.readlines()[:3]:
                        print("  " + line.rstrip())
