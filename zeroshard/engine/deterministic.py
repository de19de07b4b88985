"""What `"zeroshard": {"deterministic_reduction": true}` changes in the engine.

The reduction itself is zeroshard/grads/tree_reduce.py (`[Note: the deterministic reduction]`),
the norm zeroshard/step/optimizer_step.py, the data order and the random numbers of a micro-batch
zeroshard/engine/micro_batches.py, the config's refusals zeroshard/config/deterministic.py. Here:
the engine's part, in one place, so engine.py only asks.

- The layout: every shard is cut at a multiple of NORM_BLOCK_NUMEL elements.
- Refusals that only the built model or the training loop can show: MoE layers with
  ep_size > 1, no_sync(), coalesce_grad_reduction(), backward(scale_wrt_gas=False), and a
  set_gradient_accumulation_boundary() that contradicts the counted boundary (Accelerate calls
  it every micro-step with the value the counting gives, which is accepted).
- The forward's random numbers: those of its global micro-batch.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import torch

from zeroshard.engine.micro_batches import micro_batch_rng, micro_batch_seed
from zeroshard.grads.tree_reduce import NORM_BLOCK_NUMEL
from zeroshard.sharding.layout import ParallelLayout

KEY = "zeroshard.deterministic_reduction"


def aligned_layout(layout: ParallelLayout) -> ParallelLayout:
    """`layout` with dense (and so expert) shards cut at multiples of NORM_BLOCK_NUMEL."""
    return dataclasses.replace(layout, dense=dataclasses.replace(layout.dense, shard_align=NORM_BLOCK_NUMEL))


def check_expert_groups(layout: ParallelLayout, expert_group_names: list[str]) -> None:
    """Refuse MoE layers whose experts are spread over several ranks (ep_size > 1)."""
    for name in expert_group_names:
        edp = layout.expert_data_parallel[name]
        if edp.size != layout.world.size:
            raise ValueError(
                f"{KEY}=true: the MoE layers of expert group '{name}' spread their experts over "
                f"{layout.world.size // edp.size} ranks (ep_size), so an expert computes on the tokens of several "
                "ranks' micro-batches in one matmul and its gradient depends on which micro-batches share a "
                "group. Build the MoE layers with ep_size=1, or turn deterministic_reduction off."
            )


def refusal(call: str, fix: str) -> RuntimeError:
    """The error for a call that would take a micro-batch's gradient out of the tree."""
    return RuntimeError(
        f"{call} with {KEY}: every micro-batch's gradient is one leaf of the summation tree, reduced by its "
        f"own backward, and each step holds gradient_accumulation_steps of them. {fix}"
    )


def check_boundary(engine: Any, is_boundary: bool) -> None:
    """set_gradient_accumulation_boundary(is_boundary) must agree with the counted boundary."""
    counted = (engine.micro_steps + 1) % engine.config.gradient_accumulation_steps == 0
    if bool(is_boundary) != counted:
        raise refusal(
            f"engine.set_gradient_accumulation_boundary({is_boundary}) at micro-step {engine.micro_steps}",
            f"This micro-step {'is' if counted else 'is not'} the boundary: call it with {counted}, or not at all.",
        )


def forward_rng(engine: Any) -> contextlib.AbstractContextManager[None]:
    """A training forward draws the random numbers of its global micro-batch k = (step x GAS +
    micro-step) x W + data-parallel rank: the same at every world size (micro_batches.py)."""
    module = engine.module
    if not (module.training and torch.is_grad_enabled()):
        return contextlib.nullcontext()
    state = engine.accumulation
    layout = engine.layout
    data = layout.data if layout.data is not None else layout.world
    micro_step = engine.global_steps * engine.config.gradient_accumulation_steps + state.backwards_this_step
    k = micro_step * data.size + data.rank
    return micro_batch_rng(micro_batch_seed(engine.config.seed or 0, k, state.forwards_since_backward), engine.device)
