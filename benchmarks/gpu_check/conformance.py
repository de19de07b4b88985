"""Check a (the conformance matrix on the device) and check b (host synchronisations in
steady-state steps), on the tests' TinyModel at world size 1.

The reference is tests/dist/reference.py's single-process fp32 trainer, run on the CPU (it is the
ground truth: plain torch, no engine); the engine runs on the device with the batches moved there.
The tolerances are the CPU matrix's `TOLERANCES`, unchanged: they bound the rounding of each
precision mode (bf16's 8 or fp16's 11 significant bits, fp32's summation order), and a GPU's
kernels round within the same bounds or the engine is wrong there.
"""

from __future__ import annotations

import traceback
import warnings
from typing import Any

import torch

from tests.dist.reference import check_against_reference, flat_cat, reference_for
from tests.dist.scenarios.common import Case, build_engine, train

STAGES = (0, 1, 2, 3)
MODES = ("fp32", "bf16", "autocast_bf16", "fp16")


def to_cpu(value: Any) -> Any:
    """Every tensor in a nested dict/list result as a CPU tensor (the reference is on the CPU)."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(to_cpu(v) for v in value)
    return value


def device_step(engine, case: Case, batch) -> list[float]:
    """One optimizer step of the DeepSpeed loop up to the boundary step(), at world size 1,
    with each micro-batch moved to the engine's device."""
    tokens, targets = batch
    losses = []
    for j in range(case.ga):
        rows = slice(j * case.micro, (j + 1) * case.micro)
        loss = engine(tokens[rows].to(engine.device), targets[rows].to(engine.device))
        engine.backward(loss)
        losses.append(float(loss.detach()))
        if j < case.ga - 1:
            engine.step()
    return losses


def train_case(case: Case) -> dict[str, Any]:
    """The case trained on the device; the result as `common.train` gives it, on the CPU."""
    engine = build_engine(case)
    try:
        return to_cpu(train(engine, case, step_fn=device_step))
    finally:
        engine.destroy()


def compare(case: Case, result: dict[str, Any]) -> dict[str, Any] | tuple[str, dict[str, Any], str]:
    """Check `result` against the reference (the CPU matrix's check and tolerances); the measured
    distances (first-step gradient error over max|g|, losses' and parameters' worst), with
    ("FAIL", numbers, why) when a tolerance is broken."""
    ref = reference_for(case, world_size=1)
    losses = [sum(step) / len(step) for step in result["losses"]]
    g_ref = flat_cat(ref.grads[0])
    numbers = {
        "grad_err_rel": float((flat_cat(result["grad0"]) - g_ref).abs().max()) / float(g_ref.abs().max()),
        "loss_err_rel": max(abs(a - b) / abs(b) for a, b in zip(losses, ref.losses, strict=True)),
        "param_err_max": float((flat_cat(result["master"][-1]) - flat_cat(ref.params[-1])).abs().max()),
    }
    try:
        check_against_reference(result, ref, case.mode, case.settings, losses, case.label)
    except AssertionError as error:
        return "FAIL", numbers, str(error)
    return numbers


def conformance(stage: int, mode: str) -> dict[str, Any] | tuple[str, dict[str, Any], str]:
    """Check a, one cell: stage x mode, micro-batch 2, 2 accumulation steps, 3 optimizer steps."""
    case = Case(stage=stage, mode=mode, micro=2, ga=2, steps=3)
    return compare(case, train_case(case))


# ------------------------------------------------------------------------------ host syncs


def _zeroshard_frames(stack: list[traceback.FrameSummary]) -> list[str]:
    return [f"{f.filename.split('zeroshard/', 1)[-1]}:{f.lineno} {f.name}" for f in stack
            if "/zeroshard/" in f.filename and "/benchmarks/" not in f.filename]


def steady_state_syncs(stage: int, mode: str = "bf16", warmup: int = 2, steps: int = 2) -> tuple:
    """Check b: after `warmup` steps, `steps` more under `torch.cuda.set_sync_debug_mode`.

    Two passes on fresh engines. "warn": every synchronising call becomes a Python warning,
    raised at the torch call in the thread that made it (autograd hooks included), so its
    stack names the zeroshard frame; all are recorded. "error": the first one raises; its
    message and zeroshard frames are recorded and the pass ends (the engine is then half-way
    through a step). Nothing reads the loss or the norm inside these steps.
    """
    if not torch.cuda.is_available():
        from benchmarks.gpu_check.report import Skip

        raise Skip("needs CUDA")
    case = Case(stage=stage, mode=mode, micro=2, ga=2, steps=warmup + steps, keep=())
    from tests.dist.scenarios.common import case_batches

    batches = [(t.to("cuda"), y.to("cuda")) for t, y in case_batches(case)]
    torch.cuda.synchronize()

    def run_steps(engine, which):
        for tokens, targets in which:
            for j in range(case.ga):
                rows = slice(j * case.micro, (j + 1) * case.micro)
                engine.backward(engine(tokens[rows], targets[rows]))
                engine.step()

    seen: list[dict[str, Any]] = []
    engine = build_engine(case)
    try:
        run_steps(engine, batches[:warmup])
        torch.cuda.synchronize()
        shown = warnings.showwarning

        def record(message, category, filename, lineno, file=None, line=None):
            if "synchroniz" in str(message):
                frames = _zeroshard_frames(traceback.extract_stack()[:-1])
                seen.append({"message": str(message).splitlines()[0][:200], "zeroshard": frames[-3:]})
            else:
                shown(message, category, filename, lineno, file, line)

        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            torch.cuda.set_sync_debug_mode("warn")
            try:
                run_steps(engine, batches[warmup:])
                torch.cuda.synchronize()
            finally:
                torch.cuda.set_sync_debug_mode("default")
    finally:
        engine.destroy()

    first_error: dict[str, Any] | None = None
    engine = build_engine(case)
    try:
        run_steps(engine, batches[:warmup])
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            run_steps(engine, batches[warmup:])
        except RuntimeError as error:
            first_error = {"message": str(error).splitlines()[0][:300],
                           "zeroshard": _zeroshard_frames(traceback.extract_tb(error.__traceback__))[-3:]}
        finally:
            torch.cuda.set_sync_debug_mode("default")
            torch.cuda.synchronize()
    finally:
        engine.destroy()
    places = sorted({" <- ".join(reversed(s["zeroshard"])) or "(no zeroshard frame)" for s in seen})
    numbers = {"syncs": len(seen), "places": places, "error_mode_first": first_error}
    if seen or first_error:
        return "FAIL", numbers, f"{len(seen)} host sync(s) in {steps} steady-state steps: " + "; ".join(places)
    return "ok", numbers, ""
