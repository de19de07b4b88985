"""Building blocks shared by the rank-side scenarios: configs, engines, the training loop.

Everything here runs inside a pool worker, with torch.distributed already initialised.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

import zeroshard
from tests.dist.reference import (
    FP16_INITIAL_SCALE_POWER,
    TrainSettings,
    build_model,
    global_batches,
    micro_batch,
)
from zeroshard.zero import GatheredParameters

PRECISION_SECTIONS: dict[str, dict[str, Any]] = {
    "fp32": {},
    # bf16 with the default (fp32) gradient accumulation and reduction.
    "bf16": {"bf16": {"enabled": True}},
    # bf16 accumulation and reduction: DeepSpeed's default behaviour.
    "bf16_accum_bf16": {"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "bf16"}},
    "fp16": {"fp16": {"enabled": True, "initial_scale_power": FP16_INITIAL_SCALE_POWER}},
    # Only in the communication tests: the reduce dtype's other settings.
    "bf16_comm_bf16": {"bf16": {"enabled": True}, "communication_data_type": "bf16"},
    "fp16_accum_fp16": {
        "fp16": {"enabled": True, "initial_scale_power": FP16_INITIAL_SCALE_POWER},
        "data_types": {"grad_accum_dtype": "fp16"},
    },
    "autocast_bf16": {"torch_autocast": {"enabled": True, "dtype": "bfloat16"}},
    # Combinations DeepSpeed accepts (reference.LOSSY_MODES).
    "bf16_autocast": {"bf16": {"enabled": True}, "torch_autocast": {"enabled": True, "dtype": "bfloat16"}},
    "fp32_accum_bf16": {"data_types": {"grad_accum_dtype": "bf16"}},
    "fp32_comm_bf16": {"communication_data_type": "bf16"},
    "fp32_comm_fp16": {"communication_data_type": "fp16"},
    "bf16_accum_fp16": {"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp16"}},
    "fp16_accum_bf16": {
        "fp16": {"enabled": True, "initial_scale_power": FP16_INITIAL_SCALE_POWER},
        "data_types": {"grad_accum_dtype": "bf16"},
    },
    "autocast_comm_bf16": {
        "torch_autocast": {"enabled": True, "dtype": "bfloat16"}, "communication_data_type": "bf16",
    },
}


@dataclass
class Case:
    """One training run: what the engine is configured with and how it is driven.

    Attributes:
        stage, mode, micro, ga: ZeRO stage, precision mode (a key of PRECISION_SECTIONS),
            micro-batch size per rank, gradient_accumulation_steps.
        steps: optimizer steps.
        seed: model and data seed.
        settings: optimizer and clipping (as the reference uses them).
        extra: more config keys, merged into the config (one level deep).
        model_kwargs: passed to `build_model` (checkpointing, tiled loss).
        style: how each optimizer step's backward calls are made (a key of STYLES in
            tests/dist/scenarios/backward_styles.py; "engine" is the DeepSpeed loop).
        keep: what to return besides losses and norms: "master" (full fp32 masters after
            every step), "module" (the full module parameters, in their dtype, after every
            step), "grad0" (the full reduced gradients of the first step, read between its
            boundary backward and its `engine.step()`).
        variant: a name for a case that differs from the plain one by its `extra` keys.

    Stage 3 runs with stage3_param_persistence_threshold 0 unless `extra` sets it.
    """

    stage: int
    mode: str = "fp32"
    micro: int = 2
    ga: int = 1
    steps: int = 3
    seed: int = 0
    settings: TrainSettings = field(default_factory=TrainSettings)
    extra: dict[str, Any] = field(default_factory=dict)
    model_kwargs: dict[str, Any] = field(default_factory=dict)
    style: str = "engine"
    keep: tuple[str, ...] = ("master", "module", "grad0")
    variant: str = ""

    @property
    def label(self) -> str:
        label = f"stage{self.stage}-{self.mode}-b{self.micro}-k{self.ga}-{self.style}"
        return f"{label}-{self.variant}" if self.variant else label


def engine_config(case: Case) -> dict[str, Any]:
    """The DeepSpeed-style JSON config (a dict) of a case."""
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": case.micro,
        "gradient_accumulation_steps": case.ga,
        "optimizer": case.settings.optimizer_config(),
        "gradient_clipping": case.settings.clip,
        "zero_optimization": {"stage": case.stage},
        "steps_per_print": 1000,
    }
    if case.stage == 3:
        # Shard every unit, as a large model's would be: the default threshold (100,000
        # elements) would keep all of this tiny model's units resident, i.e. run stage 2.
        config["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    for section, value in PRECISION_SECTIONS[case.mode].items():
        config[section] = dict(value) if isinstance(value, dict) else value
    for key, value in case.extra.items():
        if isinstance(value, dict) and isinstance(config.get(key), dict):
            config[key] = {**config[key], **value}
        else:
            config[key] = value
    return config


def build_engine(case: Case, model: torch.nn.Module | None = None):
    """`zeroshard.initialize` on a fresh TinyModel (or `model`) for `case`."""
    model = model if model is not None else build_model(case.seed, **case.model_kwargs)
    engine, _, _, _ = zeroshard.initialize(model=model, config=engine_config(case))
    return engine


def case_batches(case: Case, backward_calls: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The case's global batches (the reference reads the same ones)."""
    rows = dist.get_world_size() * case.micro * case.ga * backward_calls
    return global_batches(case.seed, case.steps, rows)


def my_micro_batch(batch, micro_step: int, case: Case):
    """This rank's rows of micro-step `micro_step` of a global batch."""
    return micro_batch(batch, dist.get_rank(), micro_step, dist.get_world_size(), case.micro)


def full_masters(engine) -> dict[str, torch.Tensor]:
    """Every parameter's full fp32 master weight (a collective)."""
    return {name: zeroshard.safe_get_full_fp32_param(p) for name, p in engine.module.named_parameters()}


def full_grads(engine) -> dict[str, torch.Tensor | None]:
    """Every parameter's full reduced gradient (a collective; between backward and step)."""
    return {name: zeroshard.safe_get_full_grad(p) for name, p in engine.module.named_parameters()}


def full_optimizer_state(engine, key: str) -> dict[str, torch.Tensor | None]:
    """Every parameter's full optimizer state `key` (a collective)."""
    return {name: zeroshard.safe_get_full_optimizer_state(p, key) for name, p in engine.module.named_parameters()}


def full_module_params(engine) -> dict[str, torch.Tensor]:
    """Every parameter as the module holds it (its dtype), gathered at stage 3."""
    params = list(engine.module.named_parameters())
    with GatheredParameters([p for _, p in params]):
        return {name: p.detach().clone() for name, p in params}


def detached(loss: torch.Tensor) -> float:
    return float(loss.detach())


def engine_loop_step(engine, case: Case, batch) -> list[float]:
    """One optimizer step of the DeepSpeed loop, up to (not including) the boundary step().

    forward, engine.backward, engine.step() for every micro-batch; the last step() is left
    to the caller, so that gradients can be read between the boundary backward and it.
    """
    losses = []
    for j in range(case.ga):
        tokens, targets = my_micro_batch(batch, j, case)
        loss = engine(tokens, targets)
        engine.backward(loss)
        losses.append(detached(loss))
        if j < case.ga - 1:
            engine.step()
    return losses


StepFn = Callable[[Any, Case, Any], list[float]]


def train(engine, case: Case, step_fn: StepFn = engine_loop_step, batches=None) -> dict[str, Any]:
    """Run `case.steps` optimizer steps with `step_fn` driving each one.

    Returns a dict with, per step: "losses" (this rank's micro-batch losses),
    "grad_norms" (`get_global_grad_norm()`), "post_clip_norms", "loss_scales" (the scale the
    step ran with), "skipped" (`skipped_steps` after it), "master"/"module" snapshots (see
    `Case.keep`); "initial_master"/"initial_module" before training; "grad0".
    """
    batches = batches if batches is not None else case_batches(case)
    out: dict[str, Any] = {
        "losses": [],
        "grad_norms": [],
        "post_clip_norms": [],
        "loss_scales": [],
        "skipped": [],
        "master": [],
        "module": [],
    }
    if "master" in case.keep:
        out["initial_master"] = full_masters(engine)
    if "module" in case.keep:
        out["initial_module"] = full_module_params(engine)
    for index, batch in enumerate(batches):
        out["loss_scales"].append(engine.loss_scale)
        out["losses"].append(step_fn(engine, case, batch))
        if index == 0 and "grad0" in case.keep:
            out["grad0"] = full_grads(engine)
        engine.step()
        out["grad_norms"].append(engine.get_global_grad_norm())
        out["post_clip_norms"].append(engine.get_post_clip_grad_norm())
        out["skipped"].append(engine.skipped_steps)
        if "master" in case.keep:
            out["master"].append(full_masters(engine))
        if "module" in case.keep:
            out["module"].append(full_module_params(engine))
    out["global_steps"] = engine.global_steps
    return out
