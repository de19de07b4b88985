"""Rank-side scenarios for the deterministic reduction (tests/dist/grads/test_deterministic_reduction.py
and benchmarks/deterministic_reduction.py): the same training at any world size, with N = W x GAS
micro-batches per step, and a resume at another world size.

Every rank takes part in every collective; only rank 0 returns the (full) tensors.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist

from tests.dist.reference import build_model, global_batches
from tests.dist.scenarios.common import (
    Case,
    build_engine,
    case_batches,
    engine_loop_step,
    full_masters,
    full_optimizer_state,
    train,
)

DETERMINISTIC = {"zeroshard": {"deterministic_reduction": True}}
STATE_KEYS = {"AdamW": ("exp_avg", "exp_avg_sq"), "Muon": ("momentum_buffer", "exp_avg", "exp_avg_sq")}


def det_case(stage: int, mode: str, micro_batches: int, steps: int, extra: dict | None = None,
             deterministic: bool = True, model_kwargs: dict | None = None) -> Case:
    """`micro_batches` (W x GAS) micro-batches of 2 rows per step at this world size."""
    world = dist.get_world_size()
    merged = dict(DETERMINISTIC) if deterministic else {}
    for key, value in (extra or {}).items():
        merged[key] = {**merged.get(key, {}), **value} if isinstance(value, dict) else value
    return Case(stage=stage, mode=mode, micro=2, ga=micro_batches // world, steps=steps, extra=merged,
                keep=("grad0",), model_kwargs=model_kwargs or {})


def final_state(engine, optimizer: str = "AdamW") -> dict[str, Any]:
    """Full masters and optimizer state (collectives: every rank calls it)."""
    state = {key: full_optimizer_state(engine, key) for key in STATE_KEYS[optimizer]}
    return {"master": full_masters(engine), "state": state}


def train_cases(cases: list[dict[str, Any]], micro_batches: int = 8, steps: int = 10) -> dict[str, Any] | None:
    """Each case (keys: name, stage, mode, and optionally extra, deterministic, model_kwargs, optimizer,
    save_dir, save_at) trained `steps` steps; per name: the full masters and optimizer state after the last
    step, the grad norms, and the first step's reduced gradient. With save_dir, a checkpoint is
    saved there after step save_at (the run goes on)."""
    out = {}
    for spec in cases:
        case = det_case(spec["stage"], spec["mode"], micro_batches, steps, spec.get("extra"),
                        spec.get("deterministic", True), spec.get("model_kwargs"))
        engine = build_engine(case)
        save_dir, save_at = spec.get("save_dir"), spec.get("save_at")

        def step_fn(engine, case, batch, save_dir=save_dir, save_at=save_at):
            if save_dir is not None and engine.global_steps == save_at:
                engine.save_checkpoint(save_dir)
            return engine_loop_step(engine, case, batch)

        result = train(engine, case, step_fn)
        record = final_state(engine, spec.get("optimizer", "AdamW"))
        record.update(norms=result["grad_norms"], grad0=result["grad0"])
        out[spec["name"]] = record
        engine.destroy()
    return out if dist.get_rank() == 0 else None


def resume_cases(cases: list[dict[str, Any]], micro_batches: int = 8, steps: int = 10) -> dict[str, Any] | None:
    """Each case (keys: name, stage, mode, load_dir) loaded from its checkpoint at this world
    size and trained on to `steps` steps on the same global batches; per name the final state and
    the grad norm of every step after the load."""
    out = {}
    for spec in cases:
        case = det_case(spec["stage"], spec["mode"], micro_batches, steps, spec.get("extra"))
        engine = build_engine(case)
        engine.load_checkpoint(spec["load_dir"])
        batches = case_batches(case)
        norms = []
        for batch in batches[engine.global_steps :]:
            engine_loop_step(engine, case, batch)
            engine.step()
            norms.append(engine.get_global_grad_norm())
        record = final_state(engine)
        record.update(global_steps=engine.global_steps, norms=norms)
        out[spec["name"]] = record
        engine.destroy()
    return out if dist.get_rank() == 0 else None


def run_example(name: str, *args: str) -> tuple[int, str]:
    """Run examples/NAME with `args` as its __main__ in this worker (its group is torchrun's
    stand-in); (exit status, what rank 0 printed)."""
    import contextlib
    import io
    import runpy
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[3] / "examples" / name
    out = io.StringIO()
    saved = sys.argv
    sys.argv = [str(path), *args]
    status = 0
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(str(path), run_name="__main__")
    except SystemExit as exc:
        status = exc.code or 0
    finally:
        sys.argv = saved
    return status, out.getvalue()


def tree(values: list[torch.Tensor]) -> torch.Tensor:
    """The fixed pairwise tree, from its definition: adjacent pairs summed, an odd last value
    carried up, until one is left (independent of zeroshard's code)."""
    while len(values) > 1:
        pairs = [values[i] + values[i + 1] for i in range(0, len(values) - 1, 2)]
        values = pairs + values[len(values) - len(values) % 2 :]
    return values[0]


def reference_micro_batch_gradients(mode: str, device: torch.device, micro_batches: int = 8,
                                    micro: int = 2) -> list[dict[str, torch.Tensor]]:
    """Each of step 1's micro-batch gradients (of its mean loss; micro-batch k holds rows
    k*micro .. of the global batch), by plain torch on the unwrapped TinyModel in the mode's
    parameter dtype on `device`, as fp32."""
    model = build_model(0)
    if mode == "bf16":
        model = model.to(torch.bfloat16)
    model = model.to(device)
    tokens, targets = (t.to(device) for t in global_batches(0, 1, micro_batches * micro)[0])
    grads = []
    for k in range(micro_batches):
        replica = copy.deepcopy(model)
        rows = slice(k * micro, (k + 1) * micro)
        replica(tokens[rows], targets[rows]).backward()
        grads.append({n: p.grad.float() for n, p in replica.named_parameters() if p.grad is not None})
    return grads
