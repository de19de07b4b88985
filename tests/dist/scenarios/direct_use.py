"""Rank-side scenarios for tests/dist/sharding/test_stage3_direct_use.py: a unit's parameters used as bare
tensors by the root's code, by another unit's code, and through a weight tied to a unit."""

from __future__ import annotations

import time
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from tests.dist.harness import discard_workers
from tests.dist.reference import DIM, ODD_IN, ODD_OUT, Block, TinyModel
from tests.dist.scenarios.common import (
    Case,
    build_engine,
    case_batches,
    detached,
    engine_loop_step,
    full_grads,
    full_module_params,
    my_micro_batch,
    train,
)
from tests.dist.scenarios.faults import _outcome
from zeroshard.comm.faults import HangError

# The embedding is a unit of its own, so the head's weight, tied to it, belongs to a unit and
# is read by the root's head: the third direct-use pattern.
UNITS_WITH_EMBEDDING = {"zeroshard": {"unit_module_classes": ["PairBlock", "Embedding"]}}


class PairBlock(Block):
    """A Block whose forward can also apply the next block's maths, reading that block's
    parameters as bare tensors (the next block's module never runs)."""

    def forward(self, x: torch.Tensor, nxt: Block | None = None) -> torch.Tensor:
        x = x + torch.tanh(self.fc(self.norm(x)))
        if nxt is not None:
            normed = F.layer_norm(x, (DIM,), nxt.norm.weight, nxt.norm.bias)
            x = x + torch.tanh(F.linear(normed, nxt.fc.weight, nxt.fc.bias))
        return x


class DirectUseModel(TinyModel):
    """TinyModel's function (so the one-process TinyModel reference applies), computed with
    direct uses: block 0 by the root's code on its parameters (`addmm(bias, normed, weight.T)`),
    block 2 by block 1's forward (`F.linear(x, blocks[2].fc.weight)`), the head (tied to the
    embedding) by the root. Built after `torch.manual_seed(seed)` it has build_model(seed)'s
    weights (the same constructor draws them; the class swap draws nothing).

    `early_use` adds `0.1 * h @ blocks[1].fc.weight.T` before block 1's own forward runs (no
    longer TinyModel's function: compared with stage 0 only): in backward block 1's unit is
    reduced when its inputs' gradient is reached, before that early use's backward needs the
    weight and adds its share of the weight's gradient (a late gradient)."""

    def __init__(self, checkpointing: str | None = None, early_use: bool = False) -> None:
        super().__init__()
        self.direct_checkpointing = checkpointing
        self.early_use = early_use
        for block in self.blocks:
            block.__class__ = PairBlock

    def _run(self, fn, h: torch.Tensor) -> torch.Tensor:
        if self.direct_checkpointing is None:
            return fn(h)
        return checkpoint(fn, h, use_reentrant=self.direct_checkpointing == "reentrant")

    def _block0_by_root(self, h: torch.Tensor) -> torch.Tensor:
        b0 = self.blocks[0]
        normed = F.layer_norm(h, (DIM,), b0.norm.weight, b0.norm.bias)
        # F.linear's arithmetic (one rounding in bf16, as the reference's blocks), spelled out.
        projected = torch.addmm(b0.fc.bias, normed.flatten(0, -2), b0.fc.weight.T)
        return h + torch.tanh(projected.view_as(normed))

    def _blocks12(self, h: torch.Tensor) -> torch.Tensor:
        return self.blocks[1](h, nxt=self.blocks[2])

    def hidden(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        if self.early_use:
            h = h + 0.1 * (h @ self.blocks[1].fc.weight.T)
        h = self._run(self._block0_by_root, h)
        h = self._run(self._blocks12, h)
        h = self.norm(h)
        side = self.odd(h[..., :ODD_IN])
        return h + F.pad(side, (0, DIM - ODD_OUT))


def retained_backward_step(engine, case: Case, batch) -> list[float]:
    """`loss.backward(retain_graph=True)` then `loss.backward()`: the second backward runs
    after the first released every pin (the gradient is twice the loss's)."""
    losses = []
    for j in range(case.ga):
        tokens, targets = my_micro_batch(batch, j, case)
        loss = engine(tokens, targets)
        loss.backward(retain_graph=True)
        loss.backward()
        losses.append(detached(loss))
        if j < case.ga - 1:
            engine.step()
    return losses


STEP_FNS = {"engine": engine_loop_step, "retained": retained_backward_step}


def _gathered_units(engine) -> list[str]:
    return [unit.name for unit in engine.units[1:] if unit.gathered and unit.flats[0].params_sharded]


def run_direct_use_cases(cases: list[Case]) -> list[dict[str, Any]]:
    """Train DirectUseModel for each case; besides `common.train`'s results: the units still
    gathered after the run (a leak if any), and an eval forward's logits under no_grad."""
    results = []
    for case in cases:
        torch.manual_seed(case.seed)
        model = DirectUseModel(**case.model_kwargs)
        engine = build_engine(case, model)
        result = train(engine, case, STEP_FNS[case.style])
        result["gathered_after_training"] = _gathered_units(engine)
        engine.eval()
        tokens, _ = my_micro_batch(case_batches(case)[0], 0, case)
        with torch.no_grad(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", "None of the inputs have requires_grad")  # checkpoint in eval
            result["eval_logits"] = engine(tokens).float()
        result["gathered_after_eval"] = _gathered_units(engine)
        result["final_module"] = full_module_params(engine)
        engine.destroy()
        results.append(result)
    return results


class BlocksOnly(torch.nn.Module):
    """Every parameter in a block unit (the root unit is empty, so its gather is no
    collective): the forward's first collective is the gather of block 0 for a direct use."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(DIM, DIM) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x @ self.blocks[0].weight.T
        for block in self.blocks[1:]:
            h = torch.tanh(block(h))
        return h.sum()


def rank0_only_direct_use(case: Case, stay_s: float) -> dict[str, Any]:
    """Rank 0 alone runs a forward whose first collective is a direct use's gather; rank 1
    stays alive, outside any collective, for `stay_s` seconds. Each rank's outcome is returned."""
    torch.manual_seed(0)
    engine = build_engine(case, BlocksOnly())
    started = time.monotonic()
    error = None
    if dist.get_rank() == 0:
        try:
            with torch.no_grad():
                engine(torch.ones(2, DIM))
        except Exception as exc:  # the outcome under test
            error = exc
    else:
        try:
            time.sleep(stay_s)  # the hang watchdog interrupts this rank too
        except HangError as exc:
            error = exc
    outcome = _outcome(error, started)
    # The gathers in flight cannot be cancelled (gloo): fresh workers for the next task.
    discard_workers()
    return outcome


def unused_forward_and_released_pins() -> dict[int, dict[str, Any]]:
    """Per stage (0, 3): a forward with grad whose loss is dropped (its pins stay until the
    next backward ends), then a forward, at stage 3 `engine.empty_partition_cache()` (which
    releases every pin between that forward and its backward: the backward gathers again at
    the direct uses' outputs), the backward and a step. Returns the reduced gradients and the
    units still gathered after the step."""
    out = {}
    for stage in (0, 3):
        case = Case(stage=stage, extra=UNITS_WITH_EMBEDDING)
        torch.manual_seed(case.seed)
        engine = build_engine(case, DirectUseModel())
        tokens, targets = my_micro_batch(case_batches(case)[0], 0, case)
        engine(tokens, targets)  # dropped
        loss = engine(tokens, targets)
        if stage == 3:
            engine.empty_partition_cache()
        engine.backward(loss)
        grads = full_grads(engine)
        engine.step()
        out[stage] = {"grads": grads, "gathered": _gathered_units(engine)}
        engine.destroy()
    return out
