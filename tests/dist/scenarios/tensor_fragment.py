"""Rank-side scenarios for tests/dist/sharding/test_tensor_fragment.py: zeroshard.utils' getters and
setters on a small model with a frozen layer, in the loop a DeepSpeed user writes."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import zeroshard
import zeroshard.utils
from tests.dist.scenarios.common import PRECISION_SECTIONS, full_module_params
from zeroshard.utils import (
    safe_get_full_fp32_param,
    safe_get_full_grad,
    safe_get_full_optimizer_state,
    safe_get_local_fp32_param,
    safe_get_local_grad,
    safe_get_local_optimizer_state,
    safe_set_full_fp32_param,
    safe_set_full_grad,
    safe_set_full_optimizer_state,
    safe_set_local_fp32_param,
    safe_set_local_grad,
    safe_set_local_optimizer_state,
    safe_update_full_grad_vectorized,
)

LR, MOMENTUM = 0.1, 0.9


class Net(nn.Module):
    """Three blocks (units at stages 2-3), a head, and a frozen input projection."""

    def __init__(self, dim: int = 6) -> None:
        super().__init__()
        self.frozen = nn.Linear(dim, dim)
        self.frozen.requires_grad_(False)
        self.blocks = nn.ModuleList(nn.Linear(dim, dim) for _ in range(3))
        self.head = nn.Linear(dim, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.frozen(x)
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(x).float().pow(2).mean()


def build(stage: int, mode: str):
    torch.manual_seed(0)
    model = Net()
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "SGD", "params": {"lr": LR, "momentum": MOMENTUM}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        **PRECISION_SECTIONS[mode],
    }
    engine, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def _values(engine, seed: int) -> dict[str, torch.Tensor]:
    """A fresh fp32 value per trainable parameter, the same on every rank (full shapes: at stage 3
    a parameter outside a gather is empty, `ds_shape` keeps its shape)."""
    gen = torch.Generator().manual_seed(seed)
    return {
        n: torch.randn(getattr(p, "ds_shape", p.shape), generator=gen)
        for n, p in engine.module.named_parameters()
        if p.requires_grad
    }


def _backward(engine, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed + dist.get_rank())
    engine.backward(engine(torch.randn(2, 6, generator=gen)))


def scenario(stage: int, mode: str) -> dict[str, Any]:
    engine = build(stage, mode)
    params = dict(engine.module.named_parameters())
    trainable = {n: p for n, p in params.items() if p.requires_grad}
    out: dict[str, Any] = {}

    # Frozen: the getters answer None, the setters refuse.
    frozen = params["frozen.weight"]
    out["frozen_getters"] = [safe_get_full_fp32_param(frozen), safe_get_full_grad(frozen),
                             safe_get_full_optimizer_state(frozen, "momentum_buffer"),
                             safe_get_local_fp32_param(frozen), safe_get_local_grad(frozen)]
    # The same getters by their top-level names (zeroshard.safe_get_full_*).
    top_level = []
    for getter, args in ((zeroshard.safe_get_full_fp32_param, ()), (zeroshard.safe_get_full_grad, ()),
                         (zeroshard.safe_get_full_optimizer_state, ("momentum_buffer",))):
        try:
            top_level.append(getter(frozen, *args))
        except Exception as exc:  # recorded, so the test names what the getter did instead
            top_level.append(f"{type(exc).__name__}: {exc}")
    out["frozen_top_level_getters"] = top_level
    out["same_functions"] = [getattr(zeroshard, name) is getattr(zeroshard.utils, name) for name in
                             ("safe_get_full_fp32_param", "safe_get_full_grad", "safe_get_full_optimizer_state")]
    try:
        safe_set_full_fp32_param(frozen, torch.zeros(frozen.shape))
        out["frozen_setter"] = "accepted"
    except ValueError as exc:
        out["frozen_setter"] = str(exc)

    # Masters: set, read back, and the module computes with them.
    weights = _values(engine, 1)
    for n, p in trainable.items():
        safe_set_full_fp32_param(p, weights[n])
    out["weights"] = weights
    out["weights_read"] = {n: safe_get_full_fp32_param(p) for n, p in trainable.items()}
    out["module_after_set"] = {n: t for n, t in full_module_params(engine).items() if n in trainable}

    # Gradients: set after the boundary backward, read back; the step applies exactly them.
    _backward(engine, 10)
    grads = _values(engine, 2)
    for n, p in trainable.items():
        safe_set_full_grad(p, grads[n])
    out["grads"] = grads
    out["grads_read"] = {n: safe_get_full_grad(p) for n, p in trainable.items()}
    safe_update_full_grad_vectorized(list(params.values()), lambda g, p: g * 2)
    out["grads_doubled"] = {n: safe_get_full_grad(p) for n, p in trainable.items()}
    engine.step()
    out["after_step1"] = {n: safe_get_full_fp32_param(p) for n, p in trainable.items()}
    out["momentum1"] = {n: safe_get_full_optimizer_state(p, "momentum_buffer") for n, p in trainable.items()}

    # Optimizer state: set, read back; the next step uses it.
    buffers = _values(engine, 3)
    for n, p in trainable.items():
        safe_set_full_optimizer_state(p, buffers[n], "momentum_buffer")
    out["buffers"] = buffers
    out["buffers_read"] = {n: safe_get_full_optimizer_state(p, "momentum_buffer") for n, p in trainable.items()}
    _backward(engine, 20)
    grads2 = _values(engine, 4)
    for n, p in trainable.items():
        safe_set_full_grad(p, grads2[n])
    out["grads2"] = grads2
    engine.step()
    out["after_step2"] = {n: safe_get_full_fp32_param(p) for n, p in trainable.items()}

    # Local parts: every rank's parts make the whole; a local set is read back by the full getter.
    _backward(engine, 30)
    local = {}
    for n, p in trainable.items():
        parts = [safe_get_local_fp32_param(p), safe_get_local_grad(p),
                 safe_get_local_optimizer_state(p, "momentum_buffer")]
        local[n] = parts
        safe_set_local_fp32_param(p, parts[0] + 1.0)
        safe_set_local_grad(p, parts[1] * 3.0)
        safe_set_local_optimizer_state(p, parts[2] - 1.0, "momentum_buffer")
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    out["local_parts"] = gathered
    out["after_local_set"] = {
        n: (safe_get_full_fp32_param(p), safe_get_full_grad(p), safe_get_full_optimizer_state(p, "momentum_buffer"))
        for n, p in trainable.items()
    }
    out["before_local_set"] = {
        n: (out["after_step2"][n], None, None) for n in trainable
    }
    return out


def run_all_scenarios(cases: list[tuple[int, str]]) -> list[dict[str, Any]]:
    return [scenario(stage, mode) for stage, mode in cases]


def deepspeed_set_scenario(stage: int, mode: str, offload: bool) -> dict[str, bool]:
    """DeepSpeed 0.19's TestTensorFragmentSet (tests/unit/runtime/zero/test_zero_tensor_fragment.py):
    Adam; after the backward a full (and a local) weight and gradient are set, the gradient in the
    parameter's dtype; after the step a weight, exp_avg and exp_avg_sq. Each is read back and
    compared with torch.equal, as DeepSpeed does. Returns {check: passed}."""
    torch.manual_seed(0)
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-6}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        **PRECISION_SECTIONS[mode],
    }
    if offload:
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    model = Net()
    engine, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=config)
    trainable = {n: p for n, p in engine.module.named_parameters() if p.requires_grad}
    grad_dtype = next(iter(trainable.values())).dtype
    gen = torch.Generator().manual_seed(7)  # the same values on every rank, as DeepSpeed broadcasts them

    def full_value(p, dtype=torch.float32):
        return torch.rand(getattr(p, "ds_shape", p.shape), generator=gen).to(dtype)

    local_gen = torch.Generator().manual_seed(100 + dist.get_rank())  # parts differ by rank, and in size

    def local_value(p):
        return torch.rand(safe_get_local_fp32_param(p).shape, generator=local_gen)

    setters = {"weight": (safe_set_full_fp32_param, safe_get_full_fp32_param),
               "grad": (safe_set_full_grad, safe_get_full_grad)}
    local_setters = {"weight": (safe_set_local_fp32_param, safe_get_local_fp32_param),
                     "grad": (safe_set_local_grad, safe_get_local_grad)}
    checks: dict[str, bool] = {}

    def set_and_check(keys, when):
        for key in keys:
            for n, p in trainable.items():
                if key in setters:
                    value = full_value(p, grad_dtype if key == "grad" else torch.float32)
                    setters[key][0](p, value)
                    got = setters[key][1](p)
                else:
                    value = full_value(p)
                    safe_set_full_optimizer_state(p, value, key)
                    got = safe_get_full_optimizer_state(p, key)
                checks[f"{when}/full/{key}/{n}"] = got is not None and torch.equal(value, got)
                if key in local_setters:
                    value = local_value(p)
                    local_setters[key][0](p, value)
                    got = local_setters[key][1](p)
                else:
                    value = local_value(p)
                    safe_set_local_optimizer_state(p, value, key)
                    got = safe_get_local_optimizer_state(p, key)
                checks[f"{when}/local/{key}/{n}"] = got is not None and torch.equal(value, got)

    engine.backward(engine(torch.randn(2, 6, generator=torch.Generator().manual_seed(dist.get_rank()))))
    set_and_check(("weight", "grad"), "after_backward")
    engine.step()
    set_and_check(("weight", "exp_avg", "exp_avg_sq"), "after_step")
    return checks


def run_deepspeed_set_scenarios(cases: list[tuple[int, str, bool]]) -> list[dict[str, bool]]:
    return [deepspeed_set_scenario(*case) for case in cases]
