"""The engine compiled with a real backend (inductor by default) against the single-process
reference, within each precision mode's tolerances, and against the same engine eager
(issue 40 item 3; docs/compile.md).

    python benchmarks/compile_conformance.py                          # inductor, stages 0-3, 4 modes
    python benchmarks/compile_conformance.py --backend aot_eager --json out.json
    python benchmarks/compile_conformance.py --device cuda

The suite checks `aot_eager` bitwise against eager on 2 ranks (tests/dist/engine/test_compile.py);
a cold inductor compile costs 15-25 CPU seconds per graph on a 2-core machine, so inductor is
checked here: the tests' TinyModel at world size 1 (the GPU check's conformance cells: micro-batch
2, 2 accumulation steps, 3 steps), each stage x mode compiled, compared with tests/dist/reference.py
by its `check_against_reference` and `TOLERANCES` (unchanged: inductor fuses and reorders fp32/bf16
arithmetic, which is what those tolerances bound), and with the eager engine's parameters.

Columns: `ref` ok or FAIL (with the first broken bound), the distances from the reference
(`grad_err_rel`: first-step gradient over max|g|, `loss_err_rel`, `param_err_max`), `vs_eager`
(the largest parameter difference from the eager engine after the last step), `first_s` (the
first optimizer step, compiling included: on the first row of a dtype the compile time), `step_ms`
(the median of the later steps). Prints a table; --json writes the rows. Nothing asserts: the
exit status is 1 when a row is outside its tolerances.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # zeroshard and tests from the checkout

from benchmarks.gpu_check.conformance import compare, device_step, to_cpu  # noqa: E402
from benchmarks.process_group import init_group_of_one  # noqa: E402
from tests.dist.reference import flat_cat  # noqa: E402
from tests.dist.scenarios.common import Case, build_engine, train  # noqa: E402


def timed_step(times: list[float]):
    def step(engine, case, batch):
        start = time.perf_counter()
        losses = device_step(engine, case, batch)
        if engine.device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        return losses

    return step


def run(case: Case, backend: str | None, options: dict[str, Any] | None = None) -> tuple[dict[str, Any], list[float]]:
    engine = build_engine(case)
    if backend is not None:
        engine.compile(backend=backend, compile_kwargs={"options": options} if options else None)
    times: list[float] = []
    try:
        result = to_cpu(train(engine, case, step_fn=timed_step(times)))
        result["device"] = str(engine.device)
    finally:
        engine.destroy()
    return result, times


def row(stage: int, mode: str, backend: str, options: dict[str, Any] | None = None) -> dict[str, Any]:
    case = Case(stage=stage, mode=mode, micro=2, ga=2, steps=3)
    compiled, times = run(case, backend, options)
    eager, eager_times = run(case, None)
    checked = compare(case, compiled)
    status, numbers, why = ("FAIL", *checked[1:]) if isinstance(checked, tuple) else ("ok", checked, "")
    return {
        "stage": stage, "mode": mode, "backend": backend, "ref": status, "why": why, **numbers,
        "vs_eager": float((flat_cat(compiled["master"][-1]) - flat_cat(eager["master"][-1])).abs().max()),
        "first_s": times[0], "step_ms": 1e3 * statistics.median(times[1:]),
        "eager_step_ms": 1e3 * statistics.median(eager_times[1:]),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--stages", default="0,1,2,3")
    parser.add_argument("--modes", default="fp32,bf16,autocast_bf16,fp16")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--options", type=json.loads, default=None,
                        help='inductor options as JSON, e.g. \'{"emulate_precision_casts": true}\'')
    args = parser.parse_args(argv)
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    init_group_of_one(device)
    rows = []
    header = (f"{'stage':>5} {'mode':<14} {'ref':<4} {'grad_err_rel':>12} {'loss_err_rel':>12} {'param_err_max':>13} "
              f"{'vs_eager':>9} {'first_s':>7} {'step_ms':>8} {'eager_ms':>8}")
    print(f"engine.compile(backend={args.backend!r}, options={args.options}) against the reference and the eager "
          f"engine, {device}")
    print(header, flush=True)
    for mode in args.modes.split(","):
        for stage in (int(s) for s in args.stages.split(",")):
            r = row(stage, mode, args.backend, args.options)
            rows.append(r)
            print(f"{stage:>5} {mode:<14} {r['ref']:<4} {r['grad_err_rel']:>12.2e} {r['loss_err_rel']:>12.2e} "
                  f"{r['param_err_max']:>13.2e} {r['vs_eager']:>9.2e} {r['first_s']:>7.1f} {r['step_ms']:>8.1f} "
                  f"{r['eager_step_ms']:>8.1f}" + (f"  {r['why']}" if r["why"] else ""), flush=True)
    if args.json:
        args.json.write_text(json.dumps({"backend": args.backend, "device": str(device), "torch": torch.__version__,
                                         "rows": rows}, indent=1))
    torch.distributed.destroy_process_group()
    return 0 if all(r["ref"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
