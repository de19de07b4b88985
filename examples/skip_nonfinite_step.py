"""A non-finite gradient skips the step, in fp32 too (docs/reliability.md, docs/training.md).

    python examples/skip_nonfinite_step.py

One clean step, then a batch holding an infinity: its gradient is not finite, so the engine
skips that step on every rank. The parameters, the optimizer state and the scheduler stay as
they were, `engine.skipped_steps` counts it, and the next clean batch trains as usual.
"""

import math

import torch
from torch import nn

import zeroshard


def main() -> None:
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": 2},
    }
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 1))
    engine, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=config)
    x, y = torch.randn(4, 4), torch.randn(4, 1)

    def train_step(inputs):
        loss = nn.functional.mse_loss(engine(inputs), y)
        engine.backward(loss)
        engine.step()
        return loss.item()

    train_step(x)
    before = [p.detach().clone() for p in engine.module.parameters()]
    bad = x.clone()
    bad[0, 0] = math.inf
    loss = train_step(bad)
    unchanged = all(torch.equal(a, p) for a, p in zip(before, engine.module.parameters(), strict=True))
    print(f"bad batch: loss {loss}, skipped_steps {engine.skipped_steps}, global_steps {engine.global_steps}, "
          f"parameters unchanged: {unchanged}")
    train_step(x)
    changed = any(not torch.equal(a, p) for a, p in zip(before, engine.module.parameters(), strict=True))
    print(f"next clean batch: skipped_steps {engine.skipped_steps}, parameters changed: {changed}")


if __name__ == "__main__":
    main()
