"""Check m: the deterministic reduction on the device (docs/deterministic-reduction.md), in the GPU
check's group of one.

`tree_on_device(stage, mode, device)`: the tests' TinyModel with "zeroshard":
{"deterministic_reduction": true}, 8 micro-batches of 2 rows per step on one process (accumulation
8), STEPS steps (one on the CPU), run twice. Two claims on the device's kernels and streams:

- the first step's reduced gradient is bitwise the tree of the 8 micro-batch gradients plain torch
  computes on the same device (`tests/dist/scenarios/deterministic.py`), when those leaves are
  repeatable there (the reference is computed twice; a device whose backward kernels are not
  repeatable without torch.use_deterministic_algorithms gives a "leaves differ" FAIL that names it);
- the two runs end with bitwise equal masters: the reduction, its streams, the block norm and the
  step add nothing nondeterministic.

The claim across world sizes needs several ranks: tests/dist/grads/test_deterministic_reduction.py
proves it on CPU/gloo; with one GPU it is not measured.
"""

from __future__ import annotations

from typing import Any

import torch

from benchmarks.gpu_check.conformance import device_step, to_cpu
from tests.dist.scenarios.common import build_engine, full_masters, train
from tests.dist.scenarios.deterministic import det_case, reference_micro_batch_gradients, tree

MICRO_BATCHES = 8
STEPS = 3  # on the CPU one: the run there keeps the check's code alive


def _run(stage: int, mode: str, steps: int) -> dict[str, Any]:
    case = det_case(stage, mode, MICRO_BATCHES, steps)
    engine = build_engine(case)
    try:
        result = train(engine, case, step_fn=device_step)
        return to_cpu({"grad0": result["grad0"], "master": full_masters(engine), "norms": result["grad_norms"]})
    finally:
        engine.destroy()


def tree_on_device(stage: int, mode: str, device: torch.device) -> dict[str, Any] | tuple[str, dict[str, Any], str]:
    leaves = [reference_micro_batch_gradients(mode, device, MICRO_BATCHES) for _ in range(2)]
    repeatable = all(torch.equal(a[n], b[n]) for a, b in zip(*leaves, strict=True) for n in a)
    expected = {n: tree([g[n] / MICRO_BATCHES for g in leaves[0]]).cpu() for n in leaves[0][0]}
    steps = STEPS if device.type == "cuda" else 1
    first, second = _run(stage, mode, steps), _run(stage, mode, steps)
    tree_equal = all(torch.equal(first["grad0"][n], expected[n]) for n in expected)
    runs_equal = all(torch.equal(first["master"][n], second["master"][n]) for n in first["master"])
    numbers = {"leaves_repeatable": repeatable, "grad0_is_the_tree": tree_equal, "two_runs_equal": runs_equal,
               "norms": first["norms"]}
    if not repeatable:
        return "FAIL", numbers, "leaves differ: plain torch's micro-batch gradients are not repeatable on this device"
    if not (tree_equal and runs_equal):
        return "FAIL", numbers, f"stage {stage} {mode}: tree {tree_equal}, repeated run {runs_equal}"
    return numbers
