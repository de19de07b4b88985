"""Check a: the conformance matrix on the device, on the tests' TinyModel at world size 1 (check b,
the host synchronisations, is syncs.py).

The reference is tests/dist/reference.py's single-process trainer (the ground truth: plain torch,
no engine), run on the engine's device; the engine runs there with the batches moved there. The
tolerances are the CPU matrix's `TOLERANCES`, unchanged: they bound what the engine's different
order of the same arithmetic may change (bf16's 8 or fp16's 11 significant bits, fp32's summation
order) on one set of kernels. A GPU's fp16 kernels round differently from the CPU's (the first run
measured an fp16 first-step loss 1.24e-5 away from the CPU reference, past `first_loss` 1e-5, at
every stage alike), so comparing across devices would test the kernels, not the engine. That
difference is kept visible by its own row, `reference_device_vs_cpu`, with its own bound.
"""

from __future__ import annotations

from typing import Any

import torch

from tests.dist.reference import TOLERANCES, check_against_reference, flat_cat, reference_for
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


def train_case(case: Case, compile_backend: str | None = None) -> dict[str, Any]:
    """The case trained on the device (with `compile_backend`: after `engine.compile(backend=...)`);
    the result as `common.train` gives it, on the CPU, with "device" naming where the engine ran
    (where its reference runs)."""
    engine = build_engine(case)
    if compile_backend is not None:
        engine.compile(backend=compile_backend)
    try:
        result = to_cpu(train(engine, case, step_fn=device_step))
        result["device"] = str(engine.device)
        return result
    finally:
        engine.destroy()


def compare(case: Case, result: dict[str, Any]) -> dict[str, Any] | tuple[str, dict[str, Any], str]:
    """Check `result` against the reference (the CPU matrix's check and tolerances); the measured
    distances (first-step gradient error over max|g|, losses' and parameters' worst), with
    ("FAIL", numbers, why) when a tolerance is broken."""
    ref = reference_for(case, world_size=1, device=result.get("device", "cpu"))
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


def conformance(
    stage: int, mode: str, compile_backend: str | None = None
) -> dict[str, Any] | tuple[str, dict[str, Any], str]:
    """Check a, one cell: stage x mode, micro-batch 2, 2 accumulation steps, 3 optimizer steps;
    with `compile_backend`, the engine compiled (docs/compile.md), within the same tolerances."""
    case = Case(stage=stage, mode=mode, micro=2, ga=2, steps=3)
    return compare(case, train_case(case, compile_backend))


# The reference on the device against the reference on the CPU (informational: no engine is
# involved; it shows how far the two devices' kernels round apart). The first-step loss is bounded
# by one rounding of the mode's compute dtype relative to the loss: 2^-11 (fp16's unit roundoff) or
# 2^-8 (bf16's); fp32 by the CPU matrix's 1e-6 (summation order only: TF32 is off, torch's
# default). The first run's fp16 loss differed by 1.24e-5 (40x below 2^-11). The first-step
# gradient and norm take the matrix's `grad` and `first_norm` bounds (they bound a different
# rounding of the same arithmetic, which is what two devices' kernels are); later losses its
# `loss` bound; parameters 1e-5 (fp32: the matrix's 1e-6 + 1e-5 relative, parameters ~1) or
# 2 lr per step (low precision: an element whose gradient sign the rounding flips moves by 2 lr).
KERNEL_ROUNDING = {"fp32": 1e-6, "bf16": 2**-8, "autocast_bf16": 2**-8, "fp16": 2**-11}


def reference_device_vs_cpu(mode: str, device: torch.device) -> dict[str, Any] | tuple[str, dict[str, Any], str]:
    """The matrix's reference (world 1, micro-batch 2, 2 accumulation steps, 3 steps) trained on
    `device` and on the CPU: first-step loss, gradient (over max|g|) and norm, later losses, and
    the parameters after the last step."""
    case = Case(stage=0, mode=mode, micro=2, ga=2, steps=3)
    cpu = reference_for(case, world_size=1)
    dev = reference_for(case, world_size=1, device=str(device))
    g_cpu = flat_cat(cpu.grads[0])
    numbers = {
        "loss0_rel": abs(dev.losses[0] - cpu.losses[0]) / abs(cpu.losses[0]),
        "grad_rel": float((flat_cat(dev.grads[0]) - g_cpu).abs().max()) / float(g_cpu.abs().max()),
        "norm0_rel": abs(dev.grad_norms[0] - cpu.grad_norms[0]) / abs(cpu.grad_norms[0]),
        "loss_rel_later": max(abs(a - b) / abs(b) for a, b in zip(dev.losses[1:], cpu.losses[1:], strict=True)),
        "param_err_max": float((flat_cat(dev.params[-1]) - flat_cat(cpu.params[-1])).abs().max()),
    }
    tol = TOLERANCES[mode]
    bounds = {"loss0_rel": KERNEL_ROUNDING[mode], "grad_rel": tol.grad, "norm0_rel": tol.first_norm,
              "loss_rel_later": tol.loss,
              "param_err_max": 1e-5 if mode == "fp32" else 2 * case.settings.lr * case.steps + 1e-6}
    over = [f"{k} {numbers[k]:.3e} > {bound:.3e}" for k, bound in bounds.items() if numbers[k] > bound]
    if over:
        return "FAIL", numbers, f"reference on {device} vs CPU, {mode}: " + "; ".join(over)
    return numbers
