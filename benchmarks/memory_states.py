"""Per-rank model-state memory of the engine, counted exactly, against `zeroshard explain`.

    python benchmarks/memory_states.py --world-sizes 2 4 --model medium

For each stage 0-3 and world size it trains one step of a demo GPT under torchrun (gloo, CPU),
then counts, on every rank, the bytes of every tensor the engine holds for the model states:
parameters (full buffers while materialised, stage-3 shards), gradients (local and reduced
buffers), master weights (when they are not the parameters themselves) and optimizer state.
It prints those next to the estimator's numbers (zeroshard/tools/memory.py, what `explain` shows)
and writes benchmarks/results/memory_states.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def count_engine_bytes(engine) -> dict[str, int]:
    """Bytes this rank holds per model-state role (views of another buffer count zero)."""
    params = grads = masters = 0
    for flat in engine.flats:
        params += flat.full.untyped_storage().nbytes()
        if flat.param_shard is not None:
            params += flat.param_shard.numel() * flat.param_shard.element_size()
        for g in (flat.grads.local, flat.grads.reduced):
            if g is not None:
                grads += g.numel() * g.element_size()
        master = flat.master
        shares_param = master.untyped_storage().data_ptr() in (
            flat.full.untyped_storage().data_ptr(),
            flat.param_shard.untyped_storage().data_ptr() if flat.param_shard is not None else -1,
        )
        if not shares_param:
            masters += master.numel() * master.element_size()
    state = 0
    for per_param in engine.optimizer.state.values():
        for value in per_param.values():
            if hasattr(value, "numel") and value.dim() > 0:
                state += value.numel() * value.element_size()
    return {"params": params, "gradients": grads, "master_weights": masters, "optimizer_state": state}


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    import zeroshard
    from zeroshard.models import build_gpt
    from zeroshard.precision.plan import assign_param_groups
    from zeroshard.sharding.units import plan_units
    from zeroshard.tools.memory import estimate_for_config

    zeroshard.init_distributed()
    torch.manual_seed(0)
    model = build_gpt(args.model)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": {"stage": args.stage, "stage3_param_persistence_threshold": 0},
    }
    if args.mode == "bf16":
        config["bf16"] = {"enabled": True}
    if args.mode == "autocast":
        config["torch_autocast"] = {"enabled": True, "dtype": "bfloat16"}
    if args.mode == "bf16-bf16acc":
        config["bf16"] = {"enabled": True}
        config["data_types"] = {"grad_accum_dtype": "bf16"}
    engine, _, _, _ = zeroshard.initialize(model=model, config=config)
    block = model.config.block_size
    x = torch.randint(0, 256, (2, block))
    _, loss = engine(x, x)
    engine.backward(loss)
    engine.step()
    measured = count_engine_bytes(engine)
    groups = assign_param_groups(engine.precision_plan, model)
    counts: dict[str, int] = {}
    for name, p in model.named_parameters():
        counts[groups[name]] = counts.get(groups[name], 0) + p.numel()
    units = [sum(p.numel() for p in s.params) for s in plan_units(model) if s.params]
    estimate = estimate_for_config(engine.config, engine.precision_plan, counts, unit_numels=units)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, measured)
    if dist.get_rank() == 0:
        out = {
            "stage": args.stage, "world_size": dist.get_world_size(), "mode": args.mode,
            "num_params": sum(counts.values()), "measured_per_rank": gathered,
            "estimate": estimate.model_states,
        }
        Path(args.out).write_text(json.dumps(out))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--model", default="medium")
    parser.add_argument("--modes", nargs="+", default=["bf16", "bf16-bf16acc", "fp32"])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--stage", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="bf16", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    RESULTS.mkdir(exist_ok=True)
    rows = []
    for mode in args.modes:
        for ws in args.world_sizes:
            for stage in range(4):
                out = RESULTS / f"_mem_{mode}_{ws}_{stage}.json"
                cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ws),
                       __file__, "--worker", "--stage", str(stage), "--mode", mode, "--model", args.model,
                       "--out", str(out)]
                env = dict(os.environ, OMP_NUM_THREADS="1")
                subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                rows.append(json.loads(out.read_text()))
                out.unlink()
    print(f"{'mode':<13}{'W':>3}{'stage':>6}{'measured MiB/rank (max)':>26}{'estimate MiB':>14}{'ratio':>7}"
          f"   params/grads/master/optim measured (MiB)")
    for row in rows:
        per_rank = [sum(m.values()) for m in row["measured_per_rank"]]
        worst = max(row["measured_per_rank"], key=lambda m: sum(m.values()))
        est = sum(row["estimate"].values())
        mib = 1024 * 1024
        parts = "/".join(f"{worst[k] / mib:.1f}" for k in ("params", "gradients", "master_weights", "optimizer_state"))
        print(f"{row['mode']:<13}{row['world_size']:>3}{row['stage']:>6}{max(per_rank) / mib:>26.2f}"
              f"{est / mib:>14.2f}{max(per_rank) / est:>7.3f}   {parts}")
    path = RESULTS / "memory_states.json"
    path.write_text(json.dumps(rows, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
