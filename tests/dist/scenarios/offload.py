"""Rank-side scenarios for tests/dist/sharding/test_offload.py: the same runs with and without
ZeRO-Offload, and what only offload could get wrong (accumulation across backwards, a
repeated step, overflow, checkpoints)."""

from __future__ import annotations

import contextlib
import random
from dataclasses import replace
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from tests.dist.reference import micro_batch
from tests.dist.scenarios.common import (
    Case,
    build_engine,
    case_batches,
    detached,
    engine_loop_step,
    full_masters,
    full_module_params,
    full_optimizer_state,
)

OFFLOAD = {"zero_optimization": {"offload_optimizer": {"device": "cpu", "pin_memory": True}}}
OFFLOAD_PARAM = {
    "zero_optimization": {
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu", "pin_memory": True},
    }
}
ADAMW_STATE_KEYS = ("exp_avg", "exp_avg_sq", "step")


def with_offload(case: Case, offload: dict[str, Any] | None = None) -> Case:
    """`case` with the optimizer (and at stage 3 the parameters) offloaded."""
    offload = offload or (OFFLOAD_PARAM if case.stage == 3 else OFFLOAD)
    extra = dict(case.extra)
    extra["zero_optimization"] = {**extra.get("zero_optimization", {}), **offload["zero_optimization"]}
    return replace(case, extra=extra, variant=(case.variant + "-offload").lstrip("-"))


def backwards_step(engine, case: Case, batch, backwards: int) -> list[float]:
    """One optimizer step of `case.ga` micro-steps, each of `backwards` backward calls on
    its own slice of the micro-batch, bounded by `set_gradient_accumulation_boundary` (with
    `case.style == "no_sync"`, all micro-steps but the last inside `engine.no_sync()`); the
    boundary `engine.step()` is left to the caller."""
    losses = []
    world, rank = dist.get_world_size(), dist.get_rank()
    rows = case.micro // backwards
    for j in range(case.ga):
        tokens, targets = micro_batch(batch, rank, j, world, case.micro)
        quiet = case.style == "no_sync" and j < case.ga - 1
        with engine.no_sync() if quiet else contextlib.nullcontext():
            for b in range(backwards):
                engine.set_gradient_accumulation_boundary(j == case.ga - 1 and b == backwards - 1)
                loss = engine(tokens[b * rows : (b + 1) * rows], targets[b * rows : (b + 1) * rows])
                engine.backward(loss)
                losses.append(detached(loss))
        if j < case.ga - 1:
            engine.step()
    return losses


def train_backwards(case: Case, backwards: int) -> dict[str, Any]:
    """Train `case` with `backwards` backward calls per micro-step; masters, module params,
    norms and the host bytes of the gradient landing buffers after every step."""
    engine = build_engine(case)
    out: dict[str, Any] = {"master": [], "module": [], "norms": [], "host_grad_bytes": [], "losses": []}
    for batch in case_batches(case):
        out["losses"].append(backwards_step(engine, case, batch, backwards))
        engine.step()
        out["norms"].append(engine.get_global_grad_norm())
        out["master"].append(full_masters(engine))
        out["module"].append(full_module_params(engine))
        host = engine._step.host_grads
        out["host_grad_bytes"].append(None if host is None else host.nbytes())
    out["placement"] = (engine.layout.dense.placement, engine.layout.dense.param_placement)
    out["master_devices"] = sorted({str(f.master.device) for f in engine.flats})
    out["host_moves"] = None if engine._step.host_grads is None else dict(engine._step.host_grads.moves)
    out["flats"] = len(engine.flats)
    out["master_dtypes"] = sorted({str(f.master.dtype) for f in engine.flats})
    out["state_dtypes"] = sorted({str(t.dtype) for f in engine.flats for t in engine.optimizer.state[f.master].values()
                                  if isinstance(t, torch.Tensor) and t.dim() > 0})
    out["optimizer"] = type(engine.optimizer).__name__
    out["master_is_param"] = [f.master is f.param_shard or not f.master_is_own_copy for f in engine.flats]
    return out


def offload_vs_none(cases: list[tuple[Case, int]]) -> list[dict[str, Any]]:
    """Each (case, backwards) trained without and with offload."""
    return [{"none": train_backwards(case, k), "offload": train_backwards(with_offload(case), k)} for case, k in cases]


def repeated_step(cases: list[Case]) -> list[dict[str, Any]]:
    """Train each case twice: once plainly, once calling `engine.step()` a second time after
    every boundary step. Returns per run the masters, the AdamW state and global_steps."""
    results = []
    for case in cases:
        runs = {}
        for repeat in (False, True):
            engine = build_engine(case)
            out: dict[str, Any] = {"master": [], "state": [], "global_steps": [], "micro_steps": []}
            for batch in case_batches(case):
                engine_loop_step(engine, case, batch)
                engine.step()
                if repeat:
                    before = full_masters(engine)
                    engine.step()
                    after = full_masters(engine)
                    for name in before:
                        torch.testing.assert_close(after[name], before[name], rtol=0, atol=0)
                out["master"].append(full_masters(engine))
                out["state"].append({key: full_optimizer_state(engine, key) for key in ADAMW_STATE_KEYS})
                out["global_steps"].append(engine.global_steps)
                out["micro_steps"].append(engine.micro_steps)
            runs["repeat" if repeat else "plain"] = out
        results.append(runs)
    return results


def _poison(grad: torch.Tensor) -> torch.Tensor:
    grad = grad.clone()
    grad.view(-1)[0] = float("inf")
    return grad


def overflow_with_offload(cases: list[Case], bad_step: int) -> list[dict[str, Any]]:
    """Each case with and without offload; at `bad_step` rank 1's gradient of one weight
    gets an inf. Per step: masters, AdamW state, loss scale, skipped steps."""
    results = []
    for case in cases:
        runs = {}
        for name, c in (("none", case), ("offload", with_offload(case))):
            engine = build_engine(c)
            param = dict(engine.module.named_parameters())["blocks.0.fc.weight"]
            out: dict[str, Any] = {"master": [], "state": [], "scale": [], "skipped": []}
            for index, batch in enumerate(case_batches(c)):
                bad = index == bad_step and dist.get_rank() == 1
                handle = param.register_hook(_poison) if bad else None
                engine_loop_step(engine, c, batch)
                engine.step()
                if handle is not None:
                    handle.remove()
                out["master"].append(full_masters(engine))
                out["state"].append({key: full_optimizer_state(engine, key) for key in ADAMW_STATE_KEYS})
                out["scale"].append(engine.loss_scale)
                out["skipped"].append(engine.skipped_steps)
            runs[name] = out
        results.append(runs)
    return results


def _shared_dir(path: str) -> str:
    holder = [path]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def _rng_states() -> tuple:
    return (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].tolist())


def _train(engine, case: Case, batches) -> list[list[float]]:
    losses = []
    for batch in batches:
        losses.append(engine_loop_step(engine, case, batch))
        engine.step()
    return losses


def _snapshot(engine) -> dict[str, Any]:
    return {
        "master": full_masters(engine),
        "state": {key: full_optimizer_state(engine, key) for key in ADAMW_STATE_KEYS},
    }


def _assert_same(a: dict[str, Any], b: dict[str, Any], label: str) -> None:
    for name in a["master"]:
        torch.testing.assert_close(a["master"][name], b["master"][name], rtol=0, atol=0, msg=f"{label}: {name}")
        for key in ADAMW_STATE_KEYS:
            x, y = a["state"][key][name], b["state"][key][name]
            torch.testing.assert_close(x, y, rtol=0, atol=0, msg=f"{label}: {key} of {name}")


def resume_bitexact(case: Case, ckpt_dir: str, save_at: int = 2) -> dict[str, Any]:
    """An offloaded run saved after `save_at` steps and resumed into a fresh offloaded
    engine continues bit for bit like the uninterrupted run."""
    ckpt_dir = _shared_dir(ckpt_dir)
    batches = case_batches(case)
    first = build_engine(case)
    _train(first, case, batches[:save_at])
    first.save_checkpoint(ckpt_dir)
    rng_at_save = _rng_states()
    expected_losses = _train(first, case, batches[save_at:])
    expected = _snapshot(first)

    torch.manual_seed(99)
    resumed = build_engine(replace(case, seed=1))
    resumed.load_checkpoint(ckpt_dir)
    assert _rng_states()[1] == rng_at_save[1]
    losses = _train(resumed, case, batches[save_at:])
    assert losses == expected_losses, f"{case.label}: losses {losses} vs {expected_losses}"
    _assert_same(expected, _snapshot(resumed), f"{case.label}: resumed")
    return {"losses": losses}


def save_for_moving(case: Case, ckpt_dir: str, steps: int = 2) -> dict[str, Any]:
    """Train `case` for `steps` steps and save; return the full masters and AdamW state."""
    ckpt_dir = _shared_dir(ckpt_dir)
    engine = build_engine(case)
    _train(engine, case, case_batches(case)[:steps])
    engine.save_checkpoint(ckpt_dir)
    return _snapshot(engine)


def load_moved(case: Case, ckpt_dir: str) -> dict[str, Any]:
    """Load a checkpoint (saved with other offload settings, stage or world size) into a
    fresh engine for `case`; return its masters, AdamW state and module parameters."""
    ckpt_dir = _shared_dir(ckpt_dir)
    engine = build_engine(replace(case, seed=1))
    engine.load_checkpoint(ckpt_dir)
    out = _snapshot(engine)
    out["module"] = full_module_params(engine)
    out["placement"] = engine.layout.dense.placement
    return out


def modify_with_gathered_parameters(cases: list[Case]) -> list[dict[str, Any]]:
    """After one step, rank 0 sets one weight to 0.5 inside GatheredParameters(modifier_rank=0);
    returns the full masters before and after, and the module parameter after."""
    from zeroshard.zero import GatheredParameters

    results = []
    for case in cases:
        engine = build_engine(case)
        _train(engine, case, case_batches(case)[:1])
        before = full_masters(engine)
        param = dict(engine.module.named_parameters())["blocks.0.fc.weight"]
        with GatheredParameters([param], modifier_rank=0):
            if dist.get_rank() == 0:
                with torch.no_grad():
                    param.fill_(0.5)
        results.append({"before": before, "after": full_masters(engine), "module": full_module_params(engine)})
    return results


def grad_changed_before_step(cases: list[Case]) -> list[dict[str, Any]]:
    """Each case without and with offload; after every boundary backward, before the step,
    `safe_set_full_grad` doubles one parameter's gradient (so the landed host copy is stale)."""
    from zeroshard.utils import safe_get_full_grad, safe_set_full_grad

    results = []
    for case in cases:
        runs = {}
        for variant, run_case in (("none", case), ("offload", with_offload(case))):
            engine = build_engine(run_case)
            param = next(p for n, p in engine.module.named_parameters() if n.endswith("fc.weight"))
            out: dict[str, Any] = {"master": []}
            for batch in case_batches(run_case):
                engine_loop_step(engine, run_case, batch)
                safe_set_full_grad(param, safe_get_full_grad(param) * 2)
                engine.step()
                out["master"].append(full_masters(engine))
            host = engine._step.host_grads
            out["host_moves"] = None if host is None else dict(host.moves)
            runs[variant] = out
        results.append(runs)
    return results
