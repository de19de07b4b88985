"""The deterministic reduction: the whole conformance grid, and what it costs in bytes.

    python benchmarks/deterministic_reduction.py                  # grid at W = 1, 2, 4, 8, and bytes
    python benchmarks/deterministic_reduction.py --grid quick     # stages 0-3 x fp32/bf16 only
    python benchmarks/deterministic_reduction.py --bytes-only --model 1b --world-sizes 64

Grid: every case trains 10 steps of N = W x GAS = 8 micro-batches of 2 rows (the tests' TinyModel,
tests/dist/scenarios/deterministic.py) with "zeroshard": {"deterministic_reduction": true} at each
world size, and the full fp32 masters, the optimizer state and every grad norm are compared
bitwise with W = 1's. The suite (tests/dist/grads/test_deterministic_reduction.py) runs a part of
it within its time budget; this runs all of it: stages 0-3 x fp32, bf16, torch_autocast, fp16,
communication_data_type bf16, bf16 accumulation; Muon; optimizer and parameter offload; buckets
smaller than a flat; activation checkpointing; resident stage-3 units; and a default-mode control
that must differ. Prints a table (same / DIFFERS per world size) and writes JSON.

Bytes: the collectives of one optimizer step, recorded (`zeroshard.comm.recording()`) for the
default and the deterministic reduction at each world size, as bytes each rank puts on the wire
(ring all-reduce 2 (W-1)/W of the buffer; reduce-scatter, all-gather, all-to-all (W-1)/W), and
the same figures by formula for a demo preset at larger world sizes (--bytes-only: formula only,
no processes; the formula is checked against the recorder at the recorded sizes).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

MUON = {"optimizer": {"type": "Muon", "params": {"muon_lr": 0.02, "adam_lr": 0.01, "momentum": 0.95,
                                                  "weight_decay": 0.1}}}
OFFLOAD = {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}
OFFLOAD_PARAM = {"zero_optimization": {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}}
SMALL_BUCKETS = {"zero_optimization": {"reduce_bucket_size": 6000, "allgather_bucket_size": 6000}}
RESIDENT = {"zero_optimization": {"stage3_param_persistence_threshold": 320}}
MODES = ("fp32", "bf16", "autocast_bf16", "fp16", "fp32_comm_bf16", "bf16_accum_bf16")


def grid(kind: str) -> list[dict]:
    cases = [{"name": f"s{s}-{m}", "stage": s, "mode": m} for s in range(4) for m in ("fp32", "bf16")]
    if kind == "quick":
        return cases
    cases += [{"name": f"s{s}-{m}", "stage": s, "mode": m} for s in range(4) for m in MODES[2:]]
    cases += [{"name": f"s{s}-{m}-muon", "stage": s, "mode": m, "extra": MUON, "optimizer": "Muon"}
              for s in range(4) for m in ("fp32", "bf16")]
    cases += [{"name": f"s{s}-{m}-offload", "stage": s, "mode": m, "extra": OFFLOAD_PARAM if s == 3 else OFFLOAD}
              for s in (1, 2, 3) for m in ("fp32", "bf16")]
    cases += [{"name": f"s{s}-fp32-small-buckets", "stage": s, "mode": "fp32", "extra": SMALL_BUCKETS}
              for s in range(4)]
    cases += [{"name": "s3-fp32-resident", "stage": 3, "mode": "fp32", "extra": RESIDENT}]
    cases += [{"name": f"s{s}-fp32-checkpointing", "stage": s, "mode": "fp32",
               "model_kwargs": {"checkpointing": "non_reentrant"}} for s in (2, 3)]
    cases += [{"name": "control-default-s2-fp32", "stage": 2, "mode": "fp32", "deterministic": False}]
    return cases


def differing(a, b) -> bool:
    import torch

    if isinstance(a, dict):
        return any(differing(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return any(differing(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, torch.Tensor):
        return not (a.dtype == b.dtype and torch.equal(a, b))
    return a != b


# ----------------------------------------------------------------------------------------- bytes
WIRE_FACTOR = {  # bytes a rank sends, per byte of the full buffer, on a ring of W ranks
    "all_reduce": lambda w: 2 * (w - 1) / w,
    "reduce_scatter": lambda w: (w - 1) / w,
    "all_gather": lambda w: (w - 1) / w,
    "all_to_all": lambda w: (w - 1) / w,
    "broadcast": lambda w: (w - 1) / w,
}


def step_bytes(stage: int, deterministic: bool, micro_batches: int) -> dict | None:
    """Rank-side: the collectives of the third optimizer step (after two of warm-up), by op."""
    import torch.distributed as dist

    import zeroshard
    from tests.dist.scenarios.common import build_engine, case_batches, engine_loop_step
    from tests.dist.scenarios.deterministic import det_case

    case = det_case(stage, "fp32", micro_batches, 3, deterministic=deterministic)
    engine = build_engine(case)
    batches = case_batches(case)
    for batch in batches[:2]:
        engine_loop_step(engine, case, batch)
        engine.step()
    with zeroshard.comm.recording() as log:
        engine_loop_step(engine, case, batches[2])
        engine.step()
    world = dist.get_world_size()
    by_op: dict[str, dict] = {}
    for r in log.records:
        key = f"{r.op} {r.tag}"
        row = by_op.setdefault(key, {"count": 0, "bytes": 0, "wire_bytes": 0.0})
        row["count"] += 1
        row["bytes"] += r.bytes
        row["wire_bytes"] += r.bytes * WIRE_FACTOR[r.op](len(r.group) or world)
    padded = sum(f.padded_numel for f in engine.flats)
    params = sum(f.numel for f in engine.flats)
    engine.destroy()
    return {"by_op": by_op, "padded_numel": padded, "numel": params} if dist.get_rank() == 0 else None


def formula(stage: int, world: int, steps: int, unit_numels: list[int], deterministic: bool) -> dict:
    """Gradient bytes a rank sends per optimizer step (fp32 gradients, fp32 wire), by the stage's
    collectives: the reduction, and the stage-0/1 gather of the deterministic reduction and its norm."""
    from zeroshard.grads.tree_reduce import NORM_BLOCK_NUMEL

    align = NORM_BLOCK_NUMEL if deterministic else 1
    padded = sum(-(-n // (world * align)) * world * align for n in unit_numels)
    share = (world - 1) / world
    if not deterministic:
        grad = (2 * share * padded * 4) if stage < 2 else steps * share * padded * 4
        return {"grad": grad, "norm": 0.0, "padded_numel": padded}
    grad = steps * share * padded * 4 + (share * padded * 4 if stage < 2 else 0.0)
    norm = 2 * share * (padded // NORM_BLOCK_NUMEL) * 4
    return {"grad": grad, "norm": norm, "padded_numel": padded}


def unit_sizes(model_spec: str) -> list[int]:
    """Elements per unit of a demo preset or the tests' TinyModel (one flat per unit)."""
    import torch

    from zeroshard.sharding.units import plan_units

    if model_spec == "tiny-test":
        from tests.dist.reference import build_model

        model = build_model(0)
    else:
        from zeroshard.models import build_gpt

        with torch.device("meta"):
            model = build_gpt(model_spec)
    return [sum(p.numel() for p in spec.params) for spec in plan_units(model)]


# ------------------------------------------------------------------------------------------ main
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--grid", default="full", choices=["full", "quick", "none"])
    parser.add_argument("--world-sizes", default="1,2,4,8", help="world sizes (the grid needs 1 among them)")
    parser.add_argument("--micro-batches", type=int, default=8, help="N = W x GAS micro-batches per step")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--bytes-only", action="store_true", help="the byte formula only (no processes)")
    parser.add_argument("--model", default="1b", help="the demo preset the byte formula is shown for")
    parser.add_argument("--json", default=str(HERE / "results" / "deterministic_reduction.json"))
    args = parser.parse_args()
    worlds = [int(w) for w in args.world_sizes.split(",")]
    result: dict = {"micro_batches_per_step": args.micro_batches}

    if not args.bytes_only:
        from tests.dist.harness import DistPool

        cases = grid(args.grid) if args.grid != "none" else []
        runs, times, recorded = {}, {}, {}
        for world in worlds:
            if args.micro_batches % world:
                continue
            pool = DistPool(world)
            try:
                start = time.perf_counter()
                if cases:
                    runs[world] = pool.run("tests.dist.scenarios.deterministic:train_cases", cases,
                                           args.micro_batches, args.steps, timeout=3600)[0]
                times[world] = time.perf_counter() - start
                if world > 1:
                    recorded[world] = {
                        f"s{stage}-{'det' if det else 'default'}": pool.run(
                            step_bytes, stage, det, args.micro_batches, timeout=600)[0]
                        for stage in range(4) for det in (False, True)
                    }
            finally:
                pool.close()
        if cases and 1 in runs:
            table = {}
            print(f"\n{'case':34}" + "".join(f"{'W=' + str(w):>10}" for w in runs if w != 1))
            for spec in cases:
                name = spec["name"]
                row = {w: ("DIFFERS" if differing(runs[1][name], runs[w][name]) else "same") for w in runs if w != 1}
                table[name] = row
                print(f"{name:34}" + "".join(f"{row[w]:>10}" for w in row))
            control = [n for n in table if n.startswith("control")]
            wrong = [n for n, row in table.items() if (n in control) != ("DIFFERS" in row.values())]
            print(f"\n{len(table) - len(control)} deterministic cases bitwise equal to W=1 at every world size: "
                  f"{'yes' if not wrong else 'NO: ' + ', '.join(wrong)}; the default-mode control differs.")
            result["grid"] = table
            result["grid_seconds_per_world"] = times
        if recorded:
            tiny = unit_sizes("tiny-test")
            print(f"\nbytes a rank sends per step, fp32, TinyModel ({sum(tiny)} parameters, {len(tiny)} units), "
                  f"N = {args.micro_batches} micro-batches (recorded; formula in brackets). Each tiny unit is "
                  "padded to W x 4096 elements, so the ratio here is the padding's; a real model's is below.")
            print(f"{'stage':>5} {'W':>3} {'GAS':>3} {'default':>12} {'deterministic':>14} {'ratio':>6}")
            result["recorded"] = recorded
            for world, rows in recorded.items():
                gas = args.micro_batches // world
                for stage in range(4):
                    default = _grad_wire(rows[f"s{stage}-default"])
                    det = _grad_wire(rows[f"s{stage}-det"])
                    f_default = formula(stage, world, gas, tiny, False)
                    f_det = formula(stage, world, gas, tiny, True)
                    print(f"{stage:>5} {world:>3} {gas:>3} {default:>12,.0f} {det:>14,.0f} {det / default:>6.2f}"
                          f"   [{f_default['grad']:,.0f} / {f_det['grad'] + f_det['norm']:,.0f}]")
    sizes = unit_sizes(args.model) if args.model != "tiny-test" else unit_sizes("tiny-test")
    total = sum(sizes)
    print(f"\nby formula: {args.model} ({total / 1e6:.1f} M parameters, {len(sizes)} units), fp32 gradients, "
          f"GB a rank sends per optimizer step for the gradients (default -> deterministic)")
    print(f"{'W':>4} {'GAS':>4} " + " ".join(f"{'stage ' + str(s):>24}" for s in range(4)) + f" {'padding':>9}")
    formula_rows = []
    for world in sorted({*worlds, 64}):
        for gas in (1, 4):
            cells = []
            for stage in range(4):
                d, t = formula(stage, world, gas, sizes, False), formula(stage, world, gas, sizes, True)
                cells.append(f"{d['grad'] / 1e9:.3f} -> {(t['grad'] + t['norm']) / 1e9:.3f}")
                formula_rows.append({"world": world, "gas": gas, "stage": stage, "default_bytes": d["grad"],
                                     "deterministic_bytes": t["grad"] + t["norm"], "norm_bytes": t["norm"]})
            padding = formula(0, world, 1, sizes, True)["padded_numel"] / total - 1
            print(f"{world:>4} {gas:>4} " + " ".join(f"{c:>24}" for c in cells) + f" {padding:>8.2%}")
    result["formula"] = {"model": args.model, "params": total, "rows": formula_rows}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=1, default=str))
    print(f"wrote {args.json}", file=sys.stderr)


def _grad_wire(row: dict) -> float:
    """Wire bytes of the gradient collectives (tags grad and norm) of one recorded step."""
    return sum(v["wire_bytes"] for k, v in row["by_op"].items() if k.split()[1] in ("grad", "norm"))


if __name__ == "__main__":
    main()
