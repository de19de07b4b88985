"""Rank-side scenarios for tests/dist/moe/test_moe_engine.py: an MoE model trained by the engine.

The model's weights are a function of each parameter's global name (expert parameters named
by their global expert index), and rank r's micro-batches are the same for every ep_size, so
every ep_size must train the same model.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import zeroshard
from zeroshard.moe.layer import MoE
from zeroshard.moe.utils import global_expert_names, split_params_into_different_moe_groups_for_optimizer

HIDDEN, IN, OUT, TOKENS, NUM_EXPERTS = 8, 5, 3, 6, 4
GA, STEPS, LR, CLIP = 2, 2, 1e-2, 0.5


class MoEBlock(nn.Module):
    def __init__(self, ep_size: int, k: int = 2) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        expert = nn.Sequential(nn.Linear(HIDDEN, 12), nn.GELU(), nn.Linear(12, HIDDEN))
        self.moe = MoE(HIDDEN, expert, num_experts=NUM_EXPERTS, ep_size=ep_size, k=k, min_capacity=2)

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out, l_aux, _ = self.moe(self.norm(h))
        return h + out, l_aux


class MoENet(nn.Module):
    """Dense embed and head around two MoE blocks (top-2, drops at capacity factor 1)."""

    def __init__(self, ep_size: int, k: int = 2) -> None:
        super().__init__()
        self.embed = nn.Linear(IN, HIDDEN)
        self.blocks = nn.ModuleList([MoEBlock(ep_size, k) for _ in range(2)])
        self.head = nn.Linear(HIDDEN, OUT)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        aux = h.new_zeros(())
        for block in self.blocks:
            h, l_aux = block(h)
            aux = aux + l_aux
        return F.mse_loss(self.head(h).float(), y) + 0.01 * aux


def global_names(model: nn.Module) -> dict[str, nn.Parameter]:
    experts = global_expert_names(model)
    return {experts.get(id(p), name): p for name, p in model.named_parameters()}


def build_model(ep_size: int, skewed: bool = False) -> MoENet:
    """`skewed`: top-1 with all-zero gate weights, so every token ties and goes to expert 0
    (argmax takes the first): experts 1-3 get no token in the first step."""
    model = MoENet(ep_size, k=1 if skewed else 2)
    with torch.no_grad():
        for name, p in global_names(model).items():
            g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
            p.copy_(torch.randn(p.shape, generator=g) * (0.4 if p.dim() > 1 else 0.1))
            if skewed and name.endswith("gate.wg.weight"):
                p.zero_()
    return model


def micro_batch(rank: int, step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 + 100 * step + 10 * micro + rank)
    return torch.randn(TOKENS, IN, generator=g), torch.randn(TOKENS, OUT, generator=g)


def rng_seed(rank: int) -> int:
    """Top-2's second-expert sampling draws from torch's RNG: the same draws for any ep_size."""
    return 1234 + rank


@dataclass(frozen=True)
class EngineCase:
    ep_size: int
    stage: int
    mode: str = "fp32"
    user_groups: bool = False  # model_parameters from split_params_into_different_moe_groups_for_optimizer
    skewed: bool = False  # every token to expert 0 (see build_model)

    @property
    def label(self) -> str:
        return (
            f"ep{self.ep_size}-stage{self.stage}-{self.mode}" + ("-user-groups" if self.user_groups else "")
            + ("-skewed" if self.skewed else "")
        )


def engine_config(case: EngineCase) -> dict[str, Any]:
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": GA,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
        "gradient_clipping": CLIP,
        "zero_optimization": {"stage": case.stage, "stage3_param_persistence_threshold": 0},
        "steps_per_print": 1000,
    }
    if case.mode == "bf16":
        config["bf16"] = {"enabled": True}
    return config


def full_by_global_name(model: nn.Module, read) -> dict[str, torch.Tensor]:
    """`read(p)` for every parameter, keyed by global name (a collective over each flat's group)."""
    return {name: read(p) for name, p in global_names(model).items()}


def train_cases(cases: list[EngineCase]) -> list[dict[str, Any]]:
    rank = dist.get_rank()
    results = []
    for case in cases:
        model = build_model(case.ep_size, case.skewed)
        params = None
        if case.user_groups:
            params = split_params_into_different_moe_groups_for_optimizer(
                {"params": list(model.parameters()), "name": "all", "lr": LR}
            )
        engine, _, _, _ = zeroshard.initialize(model=model, model_parameters=params, config=engine_config(case))
        out_groups = [(g.get("name"), bool(g.get("moe")), len(g["params"])) for g in engine.optimizer.param_groups]
        torch.manual_seed(rng_seed(rank))
        out: dict[str, Any] = {"norms": [], "masters": [], "flat_groups": [], "optimizer_groups": out_groups}
        for step in range(STEPS):
            for micro in range(GA):
                x, y = micro_batch(rank, step, micro)
                engine.backward(engine(x, y))
                if micro < GA - 1:
                    engine.step()
            if step == 0:
                out["grad0"] = full_by_global_name(engine.module, zeroshard.safe_get_full_grad)
            engine.step()
            out["norms"].append(engine.get_global_grad_norm())
            out["masters"].append(full_by_global_name(engine.module, zeroshard.safe_get_full_fp32_param))
        out["flat_groups"] = sorted({(f.spec.shard.ranks, any(
            getattr(p, "allreduce", True) is False for p in f.params)) for f in engine.flats})
        results.append(out)
    return results


# ---------------------------------------------------------------- checkpoints


def _engine(case: EngineCase):
    engine, _, _, _ = zeroshard.initialize(model=build_model(case.ep_size), config=engine_config(case))
    return engine


def _optimizer_step(engine, step: int) -> None:
    rank = dist.get_rank()
    for micro in range(GA):
        x, y = micro_batch(rank, step, micro)
        engine.backward(engine(x, y))
        engine.step()


def _snapshot(engine) -> dict[str, Any]:
    return {
        "master": full_by_global_name(engine.module, zeroshard.safe_get_full_fp32_param),
        "exp_avg": full_by_global_name(engine.module, lambda p: zeroshard.safe_get_full_optimizer_state(p, "exp_avg")),
    }


def save_then_continue(case: EngineCase, root: str) -> dict[str, Any]:
    """One step, save (tag "s1"), one more step: the state saved and the state after step 2."""
    engine = _engine(case)
    torch.manual_seed(rng_seed(dist.get_rank()))
    _optimizer_step(engine, 0)
    saved = _snapshot(engine)
    engine.save_checkpoint(root, tag="s1")
    _optimizer_step(engine, 1)
    return {"saved": saved, "after": _snapshot(engine)}


def load_then_continue(case: EngineCase, root: str, continue_training: bool = True) -> dict[str, Any]:
    """Load tag "s1" into a fresh engine for `case`; the state loaded, and after step 2."""
    engine = _engine(case)
    engine.load_checkpoint(root, tag="s1")
    loaded = _snapshot(engine)
    if not continue_training:
        return {"loaded": loaded}
    _optimizer_step(engine, 1)
    return {"loaded": loaded, "after": _snapshot(engine)}


def overflow_on_one_rank(stage: int) -> dict[str, Any]:
    """fp16, ep_size 4: only rank 3's expert gradient is infinite. Every rank must skip the
    step (the norm's all-reduce carries the inf), keep its parameters and halve the scale."""
    case = EngineCase(4, stage)
    config = engine_config(case)
    config["fp16"] = {"enabled": True, "initial_scale_power": 8, "hysteresis": 1}  # halve at the first overflow
    engine, _, _, _ = zeroshard.initialize(model=build_model(4), config=config)
    if dist.get_rank() == 3:
        expert = next(p for p in engine.module.parameters() if getattr(p, "allreduce", True) is False)
        expert.register_hook(lambda g: g * float("inf"))
    before = full_by_global_name(engine.module, zeroshard.safe_get_full_fp32_param)
    scale = engine.loss_scale
    _optimizer_step(engine, 0)
    after = full_by_global_name(engine.module, zeroshard.safe_get_full_fp32_param)
    unchanged = all(torch.equal(before[n], after[n]) for n in before)
    return {"skipped": engine.skipped_steps, "unchanged": unchanged, "scale": (scale, engine.loss_scale)}
