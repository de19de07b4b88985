"""docs/checkpoints.md, "Asynchronous saves", runnable.

    python examples/checkpoint_async.py ckpt_dir
    torchrun --nproc_per_node 2 examples/checkpoint_async.py ckpt_dir

With "checkpoint": {"writer": {"decoupled": true}}, `save_checkpoint` returns once the state
is copied to host memory; a background thread writes the files while training goes on. The
next save (or load, destroy, exit) waits for it. Trains 4 steps and saves after steps 2 and
4; a fresh engine loads the step-2 checkpoint and trains steps 3-4 again: the losses equal
the ones trained while that checkpoint was being written, bit for bit.
"""

import argparse
import time

import torch
from torch import nn

import zeroshard

CONFIG = {
    "train_micro_batch_size_per_gpu": 4,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
    "zero_optimization": {"stage": 2},
    "checkpoint": {"writer": {"decoupled": True}},  # DeepSpeed's key for decoupled (asynchronous) saves
}


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 1))


def train(engine, steps) -> list[float]:
    losses = []
    for step in steps:
        g = torch.Generator().manual_seed(1000 * step + engine.global_rank)
        x = torch.randn(4, 8, generator=g)
        loss = nn.functional.mse_loss(engine(x.to(engine.device)), x.sum(1, keepdim=True).to(engine.device))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("ckpt_dir")
    args = parser.parse_args()
    zeroshard.init_distributed()

    model = make_model()
    engine, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=CONFIG)
    train(engine, [1, 2])
    start = time.perf_counter()
    engine.save_checkpoint(args.ckpt_dir, tag="step2")     # returns once the state is in host memory
    blocked_ms = 1e3 * (time.perf_counter() - start)
    while_writing = train(engine, [3, 4])                 # runs while the files are written
    engine.save_checkpoint(args.ckpt_dir, tag="step4")     # waits for step2's files first
    engine.wait_for_checkpoint()                          # or: the next load, destroy(), exit

    model = make_model()
    resumed, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=CONFIG)
    path, _ = resumed.load_checkpoint(args.ckpt_dir, tag="step2")
    again = train(resumed, [3, 4])
    if resumed.global_rank == 0:
        print(f"save returned after {blocked_ms:.1f} ms")
        print(f"latest: {open(f'{args.ckpt_dir}/latest').read().strip()}")
        print(f"trained while writing 3-4 {while_writing}")
        print(f"resumed from {path} 3-4 {again}")
        print(f"bit-exact: {again == while_writing}")


if __name__ == "__main__":
    main()
