"""AutoTP's conformance grid and its per-rank cost (CPU, gloo): every (model, precision, stage,
accumulation) at tensor T x data W/T against the unsplit model in one process, with the
tensor-parallel collectives of a step and the parameters each rank holds.

    python benchmarks/autotp_conformance.py                      # world 4, tensor 2: the full grid
    python benchmarks/autotp_conformance.py --quick              # one stage per precision
    python benchmarks/autotp_conformance.py --world 4 --tp 4 --models qwen3-kv4

The suite (tests/dist/autotp/test_autotp.py) runs the diagonal of this grid (Llama fp32, Qwen3
bf16, accumulation 2); this script adds the other pairs, accumulation 1, more steps, and a
tensor-1 run of the same model for the time per step beside it. The models, data and
reference are the suite's (tests/dist/scenarios/autotp.py). Prints a table; writes
`--json` (default benchmarks/results/autotp_conformance.json).

Time per step here is gloo on CPU processes sharing the machine's cores: it shows what the
exchanges cost relative to tensor 1 on this machine, not a GPU's; not measured on a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODELS = {"llama": {}, "qwen3": {}, "qwen3-kv4": {"num_key_value_heads": 4}}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def grid_rows(models: list[str], precisions: list[str], stages: list[int], gas_list: list[int], steps: int, tp: int,
              baseline: bool) -> list[dict]:
    """The grid on the default process group: every rank calls it and gets its own rows (rank 0's
    are printed). tests/dist/scenarios/autotp.py's world-2 task runs one cell of it, so this glue
    is exercised by the suite."""
    import torch
    import torch.distributed as dist

    from tests.dist.scenarios import autotp as scenario
    from tests.unit.autotp import models as tiny

    world = dist.get_world_size()
    build = scenario.build
    rows = []
    try:
        for model_name in models:
            overrides = MODELS[model_name]
            # The scenario builds by kind; the grid's variants change the config of that kind.
            scenario.build = lambda k, seed=0, device=None, _o=overrides: tiny.build(k, seed, device, **_o)
            kind = model_name.split("-")[0]
            for precision in precisions:
                for gas in gas_list:
                    dp = world // tp
                    ref = scenario.reference(kind, precision, steps, dp, gas)
                    for stage in stages:
                        engine, got = scenario.train(kind, precision, stage, steps, gas, tp=tp, record=True)
                        per_step = got["train_s"] / steps
                        # ds_shape: a stage-3 parameter outside a gather is empty (its piece's shape is kept)
                        local = sum(torch.Size(getattr(p, "ds_shape", p.shape)).numel()
                                    for p in engine.module.parameters())
                        error = scenario._weight_error(engine, ref["weights"][steps - 1])
                        tensor = [c for c in got["collectives"] if c[0].startswith("tp.")]
                        rows.append({
                            "model": model_name, "precision": precision, "stage": stage, "gas": gas,
                            "tp": tp, "dp": dp,
                            "loss_diff": max(abs(a - b) for a, b in zip(got["losses"], ref["losses"], strict=True)),
                            "norm_diff": max(abs(a - b) for a, b in zip(got["norms"], ref["norms"], strict=True)),
                            "first_loss_diff": abs(got["losses"][0] - ref["losses"][0]),
                            "weight_error": error,
                            "tp_collectives_per_micro_step": len(tensor),
                            "params_per_rank": local,
                            "s_per_step": per_step,
                        })
                        del engine
                    if baseline:
                        engine, got = scenario.train(kind, precision, 2, steps, gas, tp=1)
                        rows.append({"model": model_name, "precision": precision, "stage": 2, "gas": gas, "tp": 1,
                                     "dp": world, "s_per_step": got["train_s"] / steps,
                                     "params_per_rank": sum(p.numel() for p in engine.module.parameters())})
                        del engine
    finally:
        scenario.build = build
    return rows


def worker(rank: int, world: int, port: int, args: argparse.Namespace, out_path: str) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    import zeroshard

    zeroshard.init_distributed("gloo")
    rows = grid_rows(args.models, args.precisions, args.stages, args.gas, args.steps, args.tp, args.baseline)
    if rank == 0:
        Path(out_path).write_text(json.dumps(rows))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--models", nargs="+", default=["llama", "qwen3"], choices=sorted(MODELS))
    parser.add_argument("--precisions", nargs="+", default=["fp32", "bf16"])
    parser.add_argument("--stages", nargs="+", type=int, default=[0, 1, 2, 3])
    parser.add_argument("--gas", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--quick", action="store_true", help="stages 1 and 3, accumulation 2, no tensor-1 run")
    parser.add_argument("--no-baseline", dest="baseline", action="store_false")
    parser.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "autotp_conformance.json")
    args = parser.parse_args()
    if args.quick:
        args.stages, args.gas, args.baseline = [1, 3], [2], False
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        start = time.perf_counter()
        mp.spawn(worker, args=(args.world, _port(), args, out), nprocs=args.world)
        rows = json.loads(Path(out).read_text())
    wall = time.perf_counter() - start
    header = ("model", "prec", "stage", "gas", "tp x dp", "max |dloss|", "max |dnorm|", "weights", "tp coll.",
              "params/rank", "s/step")
    print(" | ".join(header))
    for r in rows:
        split = f"{r['tp']} x {r['dp']}"
        if r["tp"] == 1:
            print(f"{r['model']} | {r['precision']} | {r['stage']} | {r['gas']} | {split} | (tensor-1 run) | | | | "
                  f"{r['params_per_rank']:,} | {r['s_per_step']:.3f}")
            continue
        print(f"{r['model']} | {r['precision']} | {r['stage']} | {r['gas']} | {split} | {r['loss_diff']:.2e} | "
              f"{r['norm_diff']:.2e} | {r['weight_error']:.2e} | {r['tp_collectives_per_micro_step']} | "
              f"{r['params_per_rank']:,} | {r['s_per_step']:.3f}")
    fp32 = [r for r in rows if r["tp"] > 1 and r["precision"] == "fp32"]
    worst = max((max(r["loss_diff"], r["norm_diff"]) for r in fp32), default=0.0)
    weights = max((r["weight_error"] for r in fp32), default=0.0)
    # The weights are reported, not judged: AdamW divides by sqrt(v) + 1e-8, so a component whose
    # gradient is near 1e-8 moves by up to lr times any relative change of it (float32 reordering).
    print(f"fp32 worst difference from the unsplit model: losses and norms {worst:.2e} (bound 1e-5), weights "
          f"{weights:.2e}; {len(rows)} runs in {wall:.0f} s")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"argv": sys.argv, "wall_s": wall, "rows": rows}, indent=1) + "\n")
    if worst > 1e-5:
        raise SystemExit(f"fp32 losses or norms differ from the unsplit model by {worst:.2e} > 1e-5")


if __name__ == "__main__":
    main()
