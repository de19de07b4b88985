"""Bytes on the wire per optimizer step, per ZeRO stage, against the theory.

    python benchmarks/comm_volume.py                      # 2 ranks, GPT "tiny", fp32 and bf16
    python benchmarks/comm_volume.py --world-size 3 --modes fp32,bf16,fp16,autocast

It starts itself under torchrun (gloo on CPU, NCCL on GPUs). Every rank builds the same
GPT (`zeroshard.models.gpt.build_gpt`), and for each stage and precision mode runs one
optimizer step (one micro-batch) inside `zeroshard.comm.recording()`. Rank 0 prints one
row per (stage, mode, op, dtype, purpose) and a total per (stage, mode), and writes
benchmarks/results/comm_volume.json (git-ignored).

What "volume" counts: what a ring algorithm moves, in buffer units. An all-reduce moves 2x
its buffer (reduce-scatter, then all-gather), a reduce-scatter or an all-gather 1x; each
rank sends (W-1)/W of that, a factor common to every stage. The recorder's bytes are full
buffers (numel x element size, padding included), so

    measured = 2 * all_reduce + reduce_scatter + all_gather     (gradient and parameter traffic)

The theory, for P parameters (the tied embedding counted once) and the contract's dtypes:
stage 0 all-reduces the gradient (2 P b_reduce); stage 1 all-reduces it (every rank keeps the
whole reduced gradient, for `param.grad`) and all-gathers the updated parameters
(2 P b_reduce + P b_param); stage 2 reduce-scatters it and all-gathers the parameters
(P b_reduce + P b_param); stage 3 reduce-scatters and gathers every unit before its forward
and its backward (P b_reduce + 2 P b_gather). With one dtype throughout that is 2 P b
(stages 0, 2) and 3 P b (stages 1, 3). Measured exceeds theory only by the padding of
each flat buffer to a multiple of W. Stage 3 runs with stage3_param_persistence_threshold 0
(otherwise this small model's blocks would stay resident and it would move what stage 2 does).
A benchmark, not a test: nothing asserts (tests/dist/comm/test_comm_dtypes.py does, exactly).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))  # zeroshard from the checkout

RESULTS = REPO_ROOT / "benchmarks" / "results" / "comm_volume.json"
STAGES = (0, 1, 2, 3)
MODES = {
    "fp32": {},
    "bf16": {"bf16": {"enabled": True}},
    "bf16-comm-bf16": {"bf16": {"enabled": True}, "communication_data_type": "bf16"},
    "fp16": {"fp16": {"enabled": True, "initial_scale_power": 8}},
    "autocast": {"torch_autocast": {"enabled": True, "dtype": "bfloat16"}},
}
RING_WEIGHT = {"all_reduce": 2, "reduce_scatter": 1, "all_gather": 1}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--model", default="tiny", help="a build_gpt preset (default: tiny)")
    parser.add_argument("--modes", default="fp32,bf16", help=f"comma list of {', '.join(MODES)}")
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    unknown = [m for m in args.modes.split(",") if m not in MODES]
    if unknown:
        parser.error(f"--modes: unknown {unknown}; choose from {', '.join(MODES)}")
    return args


def launch(args: argparse.Namespace) -> int:
    """Re-run this file on `--world-size` ranks under torchrun."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={args.world_size}",
        str(Path(__file__).resolve()),
        "--worker",
        "--model",
        args.model,
        "--modes",
        args.modes,
        "--seq-len",
        str(args.seq_len),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.call(command, env=env)


def group_sizes(engine) -> dict[str, int]:
    """Unpadded element count per precision group."""
    sizes: dict[str, int] = defaultdict(int)
    for flat in engine.flats:
        sizes[flat.role.name] += flat.numel
    return dict(sizes)


def theory_bytes(engine, stage: int) -> int:
    """Theoretical ring volume of one step in bytes (module docstring), from the plan's
    dtypes; with two precision groups (torch_autocast) each group counts in its own."""
    total = 0
    for group, numel in group_sizes(engine).items():
        role = engine.precision_plan.groups[group]
        reduce_b = role.reduce_dtype.itemsize
        if stage == 0:
            total += 2 * numel * reduce_b
        elif stage == 1:
            total += numel * (2 * reduce_b + role.param_dtype.itemsize)
        elif stage == 2:
            total += numel * (reduce_b + role.param_dtype.itemsize)
        else:
            total += numel * (reduce_b + 2 * role.gather_dtype.itemsize)
    return total


def one_step(model_name: str, mode: str, stage: int, seq_len: int) -> dict:
    import torch

    import zeroshard
    from zeroshard.models import build_gpt

    torch.manual_seed(0)
    model = build_gpt(model_name)
    num_params = model.num_params()
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "steps_per_print": 1000,
        **MODES[mode],
    }
    engine, _, _, _ = zeroshard.initialize(model=model, config=config)
    tokens = torch.randint(0, model.config.vocab_size, (2, seq_len + 1), device=engine.device)
    with zeroshard.comm.recording() as log:
        _, loss = engine(tokens[:, :-1], tokens[:, 1:])
        engine.backward(loss)
        engine.step()
    rows: dict[tuple, dict] = {}
    measured = 0
    for record in log.records:
        key = (record.op, str(record.dtype).removeprefix("torch."), record.tag)
        row = rows.setdefault(key, {"op": key[0], "dtype": key[1], "tag": key[2], "count": 0, "bytes": 0})
        row["count"] += 1
        row["bytes"] += record.bytes
        if record.tag in ("grad", "param"):
            measured += RING_WEIGHT[record.op] * record.bytes
    return {
        "stage": stage,
        "mode": mode,
        "params": num_params,
        "padded_params": sum(f.padded_numel for f in engine.flats),
        "records": list(rows.values()),
        "measured_bytes": measured,
        "theory_bytes": theory_bytes(engine, stage),
    }


def worker(args: argparse.Namespace) -> None:
    import zeroshard

    zeroshard.init_distributed()
    results = [one_step(args.model, mode, stage, args.seq_len) for mode in args.modes.split(",") for stage in STAGES]
    if zeroshard.comm.rank() != 0:
        return
    world_size = zeroshard.comm.world_size()
    print(
        f"model {args.model}: {results[0]['params']:,} parameters, world size {world_size}; "
        "bytes are full buffers (numel x element size)"
    )
    header = f"{'stage':>5} {'mode':<15} {'op':<15} {'dtype':<9} {'tag':<6} {'count':>5} {'bytes':>12}"
    print(header)
    print("-" * len(header))
    for result in results:
        for row in result["records"]:
            print(
                f"{result['stage']:>5} {result['mode']:<15} {row['op']:<15} {row['dtype']:<9} {row['tag']:<6} "
                f"{row['count']:>5} {row['bytes']:>12,}"
            )
    print()
    header = f"{'stage':>5} {'mode':<15} {'measured':>12} {'theory':>12} {'ratio':>7} {'x param bytes':>13}"
    print(header)
    print("-" * len(header))
    for result in results:
        param_bytes = result["params"] * 4
        ratio = result["measured_bytes"] / result["theory_bytes"]
        print(
            f"{result['stage']:>5} {result['mode']:<15} {result['measured_bytes']:>12,} "
            f"{result['theory_bytes']:>12,} {ratio:>7.4f} {result['measured_bytes'] / param_bytes:>13.3f}"
        )
    print(
        "\nmeasured = 2 x all_reduce + reduce_scatter + all_gather bytes (grad and param); "
        "theory: stage 0 2P b, stage 1 P (2 b_reduce + b_param), stage 2 P (b_reduce + b_param), "
        "stage 3 P (b_reduce + 2 b_gather); "
        "'x param bytes' divides by P x 4 (the fp32 parameter bytes)."
    )
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"model": args.model, "world_size": world_size, "results": results}, indent=2))
    print(f"wrote {RESULTS.relative_to(REPO_ROOT)}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    return launch(args)


if __name__ == "__main__":
    sys.exit(main())
