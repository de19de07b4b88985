"""docs/checkpoints.md, runnable: save, resume, export.

    python examples/checkpoint_resume.py ckpt_dir
    torchrun --nproc_per_node 2 examples/checkpoint_resume.py ckpt_dir

Trains 4 steps and saves after step 2; a fresh engine loads that checkpoint and trains steps
3-4 again. The resumed losses equal the uninterrupted ones bit for bit (same world size). Then
the checkpoint is consolidated into one fp32 state dict that a plain, unwrapped model loads.
"""

import argparse

import torch
from torch import nn

import zeroshard
from zeroshard.checkpoint import consolidate_fp32

CONFIG = {
    "train_micro_batch_size_per_gpu": 4,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
}


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 1))


def batch(step: int, rank: int):
    g = torch.Generator().manual_seed(1000 * step + rank)  # each rank its own batch
    x = torch.randn(4, 8, generator=g)
    return x, x.sum(1, keepdim=True)


def train(engine, steps) -> list[float]:
    losses = []
    for step in steps:
        x, y = batch(step, engine.global_rank)
        loss = nn.functional.mse_loss(engine(x.to(engine.device)), y.to(engine.device))
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
    first = train(engine, [1, 2])
    engine.save_checkpoint(args.ckpt_dir, client_state={"epoch": 3})  # collective: every rank writes its shards
    uninterrupted = train(engine, [3, 4])

    model = make_model()
    resumed, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=CONFIG)
    path, client_state = resumed.load_checkpoint(args.ckpt_dir)       # the tag that ckpt_dir/latest names
    again = train(resumed, [3, 4])

    plain = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 1))
    plain.load_state_dict(consolidate_fp32(args.ckpt_dir), strict=True)
    if resumed.global_rank == 0:
        print(f"losses 1-2 {first}")
        print(f"uninterrupted 3-4 {uninterrupted}")
        print(f"resumed 3-4 {again} from {path} client_state {client_state}")
        print(f"bit-exact: {again == uninterrupted}")
        x, y = batch(1, 0)
        print(f"plain model from the fp32 export: step-1 batch loss {nn.functional.mse_loss(plain(x), y).item():.6f}")


if __name__ == "__main__":
    main()
