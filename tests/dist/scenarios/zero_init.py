"""Rank-side scenarios for tests/dist/zero/test_zero_init.py: models built under `zeroshard.zero.Init`."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import zeroshard
from tests.dist.reference import DIM, build_model
from tests.dist.scenarios.common import (
    Case,
    build_engine,
    case_batches,
    engine_config,
    engine_loop_step,
    full_module_params,
    train,
)
from zeroshard.zero import GatheredParameters


def _shapes(model: nn.Module) -> dict[str, Any]:
    return {
        n: {"numel": p.numel(), "ds_shape": tuple(getattr(p, "ds_shape", ())), "ds_numel": getattr(p, "ds_numel", None),
            "part": None if getattr(p, "ds_tensor", None) is None else p.ds_tensor.numel()}
        for n, p in model.named_parameters()
    }


def build_under_init(
    stage: int, mode: str = "fp32", dtype: torch.dtype | None = None, extra: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The TinyModel built under Init: what it holds before initialize, and how it trains
    (against the same case built without Init)."""
    case = Case(stage=stage, mode=mode, ga=2, steps=2, keep=("master", "module", "grad0"), extra=extra or {})
    config = engine_config(case)
    with zeroshard.zero.Init(config_dict_or_path=config, dtype=dtype) as ctx:
        model = build_model(case.seed)  # TinyModel.__init__ calls embed.weight.normal_() after building embed
    out: dict[str, Any] = {"active": ctx.active, "held": _shapes(model)}
    out["tied"] = model.head.weight is model.embed.weight
    params = list(model.parameters())
    with GatheredParameters(params):  # before initialize: the parts gathered
        out["gathered"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    out["after_gathered"] = _shapes(model)
    engine, *_ = zeroshard.initialize(model=model, config=config)
    out["inside"] = train(engine, case, engine_loop_step, case_batches(case))
    plain_model = build_model(case.seed)
    out["plain_initial"] = {n: p.detach().clone() for n, p in plain_model.named_parameters()}
    out["plain"] = train(build_engine(case, plain_model), case, engine_loop_step, case_batches(case))
    return out


class Scaled(nn.Module):
    """A parameter the module fills from a child's after the child was built (and partitioned),
    a buffer, a child weight written through `.data`, a child bias replaced by `.data = ...`,
    and a parameter assigned to the child."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(DIM, DIM)
        self.register_buffer("inv_freq", torch.arange(DIM, dtype=torch.float32) / DIM)
        self.scale = nn.Parameter(torch.empty(DIM))
        with torch.no_grad():
            self.scale.copy_(self.inner.weight.sum(dim=0))  # reads a partitioned child's weight
            self.inner.weight.data.mul_(0.5)  # writes it through .data
        self.inner.bias.data = torch.linspace(-1.0, 1.0, DIM)  # replaces a partitioned child's values
        self.inner.extra = nn.Parameter(torch.full((3,), 2.0))  # a late parameter of the child

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x) * self.scale + self.inner.extra.sum() + self.inv_freq


def _scaled_values(model: nn.Module) -> dict[str, torch.Tensor]:
    with GatheredParameters(list(model.parameters())):
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def init_corners() -> dict[str, Any]:
    """Module-init corner cases, GatheredParameters(modifier_rank) before initialize, the no-op
    cases and refused options."""
    out: dict[str, Any] = {}
    config = engine_config(Case(stage=3))
    torch.manual_seed(1)
    plain = _build_scaled()
    torch.manual_seed(1)
    with zeroshard.zero.Init(config_dict_or_path=config):
        inside = _build_scaled()
    out["held"] = _shapes(inside)
    out["buffer"] = inside[0].inv_freq.clone()
    out["plain"] = {n: p.detach().clone() for n, p in plain.named_parameters()}
    out["inside"] = _scaled_values(inside)
    out["patched_after_exit"] = hasattr(nn.Linear.__init__, "_zeroshard_original")
    with zeroshard.zero.Init(config_dict_or_path=config):

        class Late(nn.Module):  # defined inside the context: the __init_subclass__ path
            def __init__(self) -> None:
                super().__init__()
                self.w = nn.Parameter(torch.ones(5))

        late = Late()
    out["late"] = (late.w.numel(), tuple(late.w.ds_shape))
    # modifier_rank: rank 0's change reaches every rank's part; rank 1's is discarded.
    with GatheredParameters([inside[0].inner.bias], modifier_rank=0):
        with torch.no_grad():
            inside[0].inner.bias.fill_(7.0 if torch.distributed.get_rank() == 0 else -1.0)
    out["modified"] = _scaled_values(inside)["0.inner.bias"]
    # Below stage 3, and with enabled=False: nothing happens.
    for label, kwargs in (("stage1", {"config_dict_or_path": engine_config(Case(stage=1))}),
                          ("disabled", {"config_dict_or_path": config, "enabled": False})):
        with zeroshard.zero.Init(**kwargs) as ctx:
            model = nn.Linear(4, 4)
        out[label] = (ctx.active, model.weight.numel(), hasattr(model.weight, "ds_tensor"))
    # Init(module=...): an already built module is partitioned now.
    built = nn.Linear(4, 6)
    expected = built.weight.detach().clone()
    zeroshard.zero.Init(module=built, config_dict_or_path=config)
    out["module_arg_numel"] = built.weight.numel()
    with GatheredParameters([built.weight]):
        out["module_arg_equal"] = torch.equal(built.weight, expected)
    refused = {}
    for option, value in (("mpu", object()), ("zero_quantized_weights", True), ("remote_device", "nvme"),
                          ("param_swapper", object()), ("zero_param_parallel_group", object())):
        try:
            zeroshard.zero.Init(config_dict_or_path=config, **{option: value})
            refused[option] = None
        except NotImplementedError as exc:
            refused[option] = str(exc)
    out["refused"] = refused
    return out


def _build_scaled() -> nn.Module:
    return nn.Sequential(Scaled(), nn.LayerNorm(DIM))


def train_scaled_model() -> dict[str, Any]:
    """The corner-case model trains under stage 3 built with and without Init: same values."""
    config = engine_config(Case(stage=3))
    results = {}
    for label in ("plain", "inside"):
        torch.manual_seed(1)
        if label == "inside":
            with zeroshard.zero.Init(config_dict_or_path=config):
                model = _build_scaled()
        else:
            model = _build_scaled()
        engine, *_ = zeroshard.initialize(model=model, config=config)
        gen = torch.Generator().manual_seed(5 + torch.distributed.get_rank())
        for _ in range(2):
            x = torch.randn(2, DIM, generator=gen)
            engine.backward(engine(x).pow(2).mean())
            engine.step()
        results[label] = full_module_params(engine)
        results[label + "_buffer"] = engine.module[0].inv_freq.clone()
    return results


class MixedDtypeAdapterModule(nn.Module):
    """DeepSpeed 0.19's tests/unit/runtime/zero/test_zero_autocast_mixed_dtype.py model: a frozen
    base weight built under Init, and two fp32 adapter matrices attached after the context and
    handed to it with `base_weight.convert_to_zero_parameters([...])`."""

    def __init__(self, hidden_dim: int) -> None:
        super().__init__()
        self.hidden_dim = hidden_dim
        self.base_weight = nn.Parameter(torch.randn(hidden_dim, hidden_dim) * 0.01, requires_grad=False)

    def attach_fp32_adapter(self, rank: int) -> None:
        self.adapter_a = nn.Parameter(torch.randn(rank, self.hidden_dim) * 0.01)
        self.adapter_b = nn.Parameter(torch.randn(self.hidden_dim, rank) * 0.01)
        self.base_weight.convert_to_zero_parameters([self.adapter_a, self.adapter_b])

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        base = nn.functional.linear(x, self.base_weight)
        low_rank = nn.functional.linear(x, self.adapter_a)
        adapter = nn.functional.linear(low_rank, self.adapter_b) / self.adapter_a.shape[0]
        return nn.functional.mse_loss((base + adapter).float(), target.float())


def fp32_adapter_on_bf16_base() -> dict[str, Any]:
    """DeepSpeed's TestZero3AutocastMixedDtype loop; returns what its assertions read, and the
    full values the engine computed with (for a plain-torch reference on the test side)."""
    from zeroshard.utils import safe_get_full_fp32_param, safe_get_full_grad

    config = {
        "train_micro_batch_size_per_gpu": 1,
        "bf16": {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "torch_autocast": {"enabled": True, "dtype": str(torch.bfloat16), "lower_precision_safe_modules": [
            f"{MixedDtypeAdapterModule.__module__}.{MixedDtypeAdapterModule.__name__}"]},
        "zero_allow_untested_optimizer": True,  # not needed for AdamW; DeepSpeed's config has no such key
    }
    torch.manual_seed(0)
    with zeroshard.zero.Init(config_dict_or_path=config):
        model = MixedDtypeAdapterModule(8)
    model.attach_fp32_adapter(rank=4)
    out: dict[str, Any] = {"adapter_parts": [model.adapter_a.ds_tensor.dtype, model.adapter_a.numel()]}
    trainable = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = zeroshard.initialize(config=config, model=model, model_parameters=trainable,
                                      optimizer=torch.optim.AdamW(trainable, lr=0.1))
    module = engine.module
    with GatheredParameters(list(module.parameters())):
        out["values"] = {n: p.detach().clone() for n, p in module.named_parameters()}
    out["dtypes"] = {n: p.dtype for n, p in module.named_parameters()}
    out["before"] = safe_get_full_fp32_param(module.adapter_a).clone()
    gen = torch.Generator().manual_seed(1)  # the same batch on both ranks: the mean is that gradient
    x, target = torch.randn(2, 8, generator=gen), torch.randn(2, 8, generator=gen)
    out["batch"] = (x, target)
    engine.backward(engine(x, target))
    out["grads"] = {n: safe_get_full_grad(getattr(module, n)) for n in ("adapter_a", "adapter_b")}
    engine.step()
    out["after"] = safe_get_full_fp32_param(module.adapter_a)
    return out
