"""Shared pieces of the checkpoint tests: a small model, configs, data, snapshots, comparisons.

No tests here. Everything is module level so the pooled workers can import it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

import zeroshard

VOCAB, DIM, BLOCKS, SEQ = 13, 8, 3, 5
GLOBAL_BATCH = 6  # divisible by world sizes 1, 2 and 3


class Block(nn.Module):
    def __init__(self, dim: int, dropout: float) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.lin = nn.Linear(dim, dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(torch.tanh(self.lin(self.norm(x))))


class TinyLM(nn.Module):
    """Every kind of thing a checkpoint must carry: units (the blocks), a tied lm head, a 0-d
    parameter, a frozen parameter, a persistent and a non-persistent buffer, dropout (RNG)."""

    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block(DIM, dropout) for _ in range(BLOCKS))
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.emb.weight
        self.temperature = nn.Parameter(torch.tensor(1.25))
        self.frozen_gain = nn.Parameter(torch.linspace(0.9, 1.1, DIM), requires_grad=False)
        self.register_buffer("logit_bias", torch.linspace(-0.1, 0.1, VOCAB))
        self.register_buffer("scratch", torch.zeros(2), persistent=False)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for block in self.blocks:
            h = block(h)
        logits = self.head(h * self.frozen_gain) * self.temperature + self.logit_bias
        return nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), y.reshape(-1))


MODES = {
    "fp32": {},
    "bf16": {"bf16": {"enabled": True}},
    "fp16": {"fp16": {"enabled": True, "initial_scale_power": 10, "loss_scale_window": 2}},
    "autocast": {"torch_autocast": {"enabled": True, "dtype": "bfloat16"}},
    "bf16_master": {"bf16": {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}},
    # bf16 master weights with fp32 optimizer state (StateDtypeAdamW).
    "bf16_master_fp32_state": {"bf16": {"enabled": True, "bf16_master_weights_and_grads": True}},
}


def make_config(stage: int, mode: str, world_size: int, ga: int = 2, optimizer: str = "AdamW") -> dict:
    params = {"lr": 0.02, "weight_decay": 0.01} if optimizer == "AdamW" else {"lr": 0.05, "momentum": 0.9}
    return {
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // world_size,
        "gradient_accumulation_steps": ga,
        "optimizer": {"type": optimizer, "params": params},
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_num_steps": 5, "warmup_max_lr": 0.02, "warmup_type": "linear"},
        },
        # Threshold 0: every unit is really sharded at stage 3 (the default keeps units this
        # small resident, which would make stage 3 behave as stage 2 here).
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "gradient_clipping": 1.0,
        **MODES[mode],
    }


def make_engine(stage: int, mode: str, seed: int = 0, ga: int = 2, dropout: float = 0.0, **kwargs):
    torch.manual_seed(seed)
    model = TinyLM(dropout)
    world = dist.get_world_size() if dist.is_initialized() else 1
    engine, *_ = zeroshard.initialize(model=model, config=make_config(stage, mode, world, ga, **kwargs))
    return engine


def global_batch(step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + micro)
    x = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=gen)
    y = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=gen)
    return x, y


def rank_batch(step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    per = GLOBAL_BATCH // world
    x, y = global_batch(step, micro)
    return x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]


def train(engine, first_step: int, last_step: int) -> list[float]:
    """Optimizer steps first_step..last_step-1; the mean loss over all ranks of each step."""
    losses = []
    ga = engine.gradient_accumulation_steps()
    for step in range(first_step, last_step):
        total = torch.zeros(())
        for micro in range(ga):
            loss = engine(*rank_batch(step, micro))
            engine.backward(loss)
            engine.step()
            total += loss.detach().float()
        if dist.is_initialized():
            dist.all_reduce(total)
            total /= dist.get_world_size()
        losses.append(float(total / ga))
    return losses


def snapshot(engine) -> dict:
    """Full (unsharded) master weights, optimizer state, loss scale and counters. Collective."""
    params, states = {}, {}
    for name, p in engine.module.named_parameters():
        if not p.requires_grad:
            continue
        params[name] = zeroshard.safe_get_full_fp32_param(p)
        for key in ("exp_avg", "exp_avg_sq", "momentum_buffer", "step"):
            value = zeroshard.safe_get_full_optimizer_state(p, key)
            if value is not None:
                states[f"{name}:{key}"] = value
    module_params = {}
    for name, p in engine.module.named_parameters():
        if p.requires_grad and engine.policy.stage == 3:
            continue  # sharded: not materialised between uses
        module_params[name] = p.detach().clone()
    return {
        "params": params,
        "optimizer": states,
        "module": module_params,
        "buffers": {n: b.detach().clone() for n, b in engine.module.named_buffers()},
        "loss_scale": engine.loss_scale,
        "counters": (engine.global_steps, engine.micro_steps, engine.skipped_steps),
        "lr": engine.get_lr(),
    }


def assert_tensors_equal(expected: dict, actual: dict, what: str) -> None:
    """Bitwise equality of two name -> tensor dicts, with a message naming the first difference."""
    assert expected.keys() == actual.keys(), f"{what}: names differ: {sorted(expected)} vs {sorted(actual)}"
    for name in expected:
        a, b = expected[name], actual[name]
        if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a, b):
            diff = (a.double() - b.double()).abs().max().item() if a.shape == b.shape else "shape"
            raise AssertionError(f"{what}: {name} differs (dtype {a.dtype} vs {b.dtype}, max |diff| {diff})")


def assert_snapshots_equal(expected: dict, actual: dict, what: str) -> None:
    for part in ("params", "optimizer", "module", "buffers"):
        assert_tensors_equal(expected[part], actual[part], f"{what} [{part}]")
    for part in ("loss_scale", "counters", "lr"):
        assert expected[part] == actual[part], f"{what} [{part}]: {expected[part]} vs {actual[part]}"
