"""docs/training.md's snippets, runnable: full gradients, master weights, optimizer state and
parameters at ZeRO stage 3, and the log of the collectives one step issues.

    python examples/full_tensors.py                          # one process
    torchrun --nproc_per_node 2 examples/full_tensors.py     # two: the tensors are shards there

tests/unit/compat/test_docs_examples.py compares the printed full gradient with plain PyTorch's.
"""

import torch
from torch import nn

import zeroshard
from zeroshard import safe_get_full_fp32_param, safe_get_full_grad, safe_get_full_optimizer_state
from zeroshard.zero import GatheredParameters


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, x):
        return x + torch.tanh(self.fc(x))


class Model(nn.Module):
    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim) for _ in range(3))
        self.head = nn.Linear(dim, 1)

    def forward(self, x, y):
        for block in self.blocks:
            x = block(x)
        return nn.functional.mse_loss(self.head(x), y)


def main() -> None:
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }
    torch.manual_seed(0)  # the same model and batch on every rank
    model = Model()
    x, y = torch.randn(4, 8), torch.randn(4, 1)
    zeroshard.init_distributed()
    engine, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=config)
    w = engine.module.blocks[0].fc.weight
    print(f"stage 3: blocks.0.fc.weight holds {w.numel()} elements on this rank outside a gather")

    with zeroshard.comm.recording() as log:
        loss = engine(x.to(engine.device), y.to(engine.device))
        engine.backward(loss)                               # the boundary backward
        grad = safe_get_full_grad(w)                        # reduced, unscaled; valid until step()
        engine.step()
    master = safe_get_full_fp32_param(w)                    # fp32 master weight, full shape
    exp_avg = safe_get_full_optimizer_state(w, "exp_avg")
    if engine.global_rank == 0:
        print(f"loss {loss.item():.6f}")
        print(f"full grad {tuple(grad.shape)} sum {grad.sum().item():.6f} norm {grad.norm().item():.6f}")
        print(f"master {tuple(master.shape)} exp_avg {tuple(exp_avg.shape)}")
        for r in log.records:
            print("collective", r.op, r.dtype, r.numel, r.bytes, r.tag)

    with GatheredParameters([w], modifier_rank=0):          # full parameters, even at stage 3
        if engine.global_rank == 0:
            w.data.zero_()                                  # broadcast from rank 0, written back on exit
    after = safe_get_full_fp32_param(w)
    if engine.global_rank == 0:
        print(f"after GatheredParameters: |master| = {after.abs().sum().item():.1f}")


if __name__ == "__main__":
    main()
