"""FP8 against bf16 on the demo GPT: is fp8's loss within bf16's own band? (docs/precision.md)

Two gloo ranks (tests/dist/harness.py's pool) train the demo GPT ("tiny" preset, its block
Linears in fp8 with min_features 16, torchao's emulation on CPU) on the demo's corpus, the DeepSpeed
loop, for --steps steps, once per seed in bf16 and once in fp8, at each stage of --stages.

The band: bf16's loss differs from seed to seed (the initialisation and the batches both come
from the seed). Per seed, L = the mean loss over the last 10 steps; the band is max - min of the
bf16 runs' L over the seeds. fp8 passes when, for every seed, |L_fp8 - L_bf16| is within the
band. The table also shows, per step of the first three, the bf16 spread over seeds and the
largest |fp8 - bf16| (the suite's short check, tests/dist/precision/test_fp8.py, bounds the
latter). Writes the losses and the verdict as JSON (--json).

    python benchmarks/fp8_band.py --steps 50 --seeds 3 --stages 3 --json fp8_band.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tests.dist.harness import DistPool  # noqa: E402

WINDOW = 10  # the last steps averaged into L


def run_seed(stage: int, fp8: bool, seed: int, steps: int, micro: int, seq: int) -> dict:
    """Rank side: one training run; the per-step losses (every rank's mean) and seconds."""
    import torch.distributed as dist

    from tests.dist.scenarios.fp8 import batches, build, train

    data = batches(seed, steps, dist.get_world_size() * micro, seq)
    engine = build(stage, fp8, seed, micro, 1)
    start = time.perf_counter()
    losses = train(engine, data, micro, 1)
    seconds = time.perf_counter() - start
    engine.destroy()
    return {"losses": losses, "seconds": seconds}


def summarise(runs: dict, seeds: list[int], stages: list[int], steps: int) -> dict:
    window = min(WINDOW, steps)

    def tail(losses):
        return sum(losses[-window:]) / window

    bf16 = {s: tail(runs[("bf16", stages[0], s)]["losses"]) for s in seeds}
    band = max(bf16.values()) - min(bf16.values())
    result = {"window": window, "band": band, "bf16_tail": bf16, "stages": {}}
    for stage in stages:
        gaps = {s: abs(tail(runs[("fp8", stage, s)]["losses"]) - bf16[s]) for s in seeds}
        result["stages"][stage] = {"gap": gaps, "within_band": max(gaps.values()) <= band}
    early = []
    for k in range(min(3, steps)):
        values = [runs[("bf16", stages[0], s)]["losses"][k] for s in seeds]
        gap = max(abs(runs[("fp8", st, s)]["losses"][k] - runs[("bf16", stages[0], s)]["losses"][k])
                  for s in seeds for st in stages)
        early.append({"step": k + 1, "bf16_spread": max(values) - min(values), "fp8_gap": gap})
    result["first_steps"] = early
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--stages", default="3", help="comma-separated ZeRO stages for the fp8 runs")
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    stages = [int(s) for s in args.stages.split(",")]
    seeds = list(range(args.seeds))
    pool = DistPool(2)
    runs = {}
    try:
        for seed in seeds:
            runs[("bf16", stages[0], seed)] = pool.run(
                run_seed, stages[0], False, seed, args.steps, args.micro, args.seq, timeout=3600)[0]
            for stage in stages:
                runs[("fp8", stage, seed)] = pool.run(
                    run_seed, stage, True, seed, args.steps, args.micro, args.seq, timeout=3600)[0]
    finally:
        pool.close()
    result = summarise(runs, seeds, stages, args.steps)
    print(f"demo GPT 'tiny', 2 ranks, {args.steps} steps, micro {args.micro} x seq {args.seq}, seeds {seeds}")
    print(f"L = mean loss of the last {result['window']} steps; bf16 band over seeds = {result['band']:.4f}")
    print(f"{'run':<14}" + "".join(f"{'seed ' + str(s):>12}" for s in seeds) + f"{'s/step':>10}")
    for key in [("bf16", stages[0])] + [("fp8", st) for st in stages]:
        tails = [sum(runs[(*key, s)]["losses"][-result["window"]:]) / result["window"] for s in seeds]
        per_step = sum(runs[(*key, s)]["seconds"] for s in seeds) / (len(seeds) * args.steps)
        label = f"{key[0]} stage {key[1]}"
        print(f"{label:<14}" + "".join(f"{t:>12.4f}" for t in tails) + f"{per_step:>10.3f}")
    for stage, verdict in result["stages"].items():
        gaps = ", ".join(f"{g:.4f}" for g in verdict["gap"].values())
        print(f"fp8 stage {stage}: |L_fp8 - L_bf16| per seed = {gaps}; within the band: {verdict['within_band']}")
    for row in result["first_steps"]:
        print(f"step {row['step']}: bf16 spread over seeds {row['bf16_spread']:.4f}, "
              f"largest |fp8 - bf16| {row['fp8_gap']:.4f}")
    if args.json is not None:
        args.json.write_text(json.dumps({
            "args": vars(args) | {"json": str(args.json)}, "summary": result,
            "runs": {f"{m} s{st} seed{s}": r for (m, st, s), r in runs.items()},
        }, indent=1, default=str))
    return 0 if all(v["within_band"] for v in result["stages"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
