"""Size a job on paper: memory per rank and communication per step for 8-1024 GPUs, 1B-70B params.

    python benchmarks/peers_scale.py [--config CONFIG.json] [--markdown]

Memory comes from zeroshard's own estimator (`zeroshard.tools.memory.estimate_memory`), fed with the
precision plan the config resolves to and the real units of GPT-shaped models built on the meta
device (no memory is allocated). Communication uses the same plan's wire dtypes with the stage
table of docs/design.md section 3 (the estimator has no communication function yet):

    stage 0    all-reduce of the gradients                      P x reduce bytes
    stage 1    all-reduce of the gradients + all-gather of       P x reduce + P x param bytes
               the updated parameters (sent: 2x the reduce)
    stage 2    reduce-scatter of the gradients + all-gather of   P x reduce + P x param bytes
               the updated parameters
    stage 3    reduce-scatter + all-gather before each unit's     P x reduce + 2 P x gather bytes
               forward and again before its backward

Those are buffer bytes per step (the recorder's unit); one rank sends (W-1)/W of them for an
all-gather or reduce-scatter and 2(W-1)/W for an all-reduce with ring algorithms.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import torch  # noqa: E402

from zeroshard.models import build_gpt  # noqa: E402
from zeroshard.precision.plan import assign_param_groups, resolve_precision_plan  # noqa: E402
from zeroshard.resolve import resolve_config  # noqa: E402
from zeroshard.sharding.units import plan_units  # noqa: E402
from zeroshard.tools.memory import estimate_for_config  # noqa: E402

WORLD_SIZES = (8, 64, 256, 1024)
# GPT-shaped models (12 d^2 per block, byte vocabulary): layers and width of common sizes.
MODEL_SHAPES = {
    "1B": {"n_layer": 20, "n_embd": 2048, "n_head": 16},
    "7B": {"n_layer": 32, "n_embd": 4096, "n_head": 32},
    "13B": {"n_layer": 40, "n_embd": 5120, "n_head": 40},
    "70B": {"n_layer": 80, "n_embd": 8192, "n_head": 64},
}
DEFAULT_CONFIG: dict[str, Any] = {
    "train_micro_batch_size_per_gpu": 1,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
    "bf16": {"enabled": True},
    "zero_optimization": {"stage": 3},
}
GIB = 1024**3


def _size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


_facts_cache: dict[tuple[str, tuple[str, ...]], tuple[dict[str, int], list[int]]] = {}


def _model_facts(model_name: str, plan) -> tuple[dict[str, int], list[int]]:
    """Parameter counts per precision group and unit sizes of a GPT of this shape (meta device)."""
    key = (model_name, tuple(plan.groups))
    if key not in _facts_cache:
        _facts_cache[key] = _build_facts(MODEL_SHAPES[model_name], plan)
    return _facts_cache[key]


def _build_facts(shape: dict[str, int], plan) -> tuple[dict[str, int], list[int]]:
    with torch.device("meta"):
        model = build_gpt("1b", block_size=2048, **shape)
    groups = assign_param_groups(plan, model)
    counts: dict[str, int] = {}
    for name, p in model.named_parameters():
        counts[groups[name]] = counts.get(groups[name], 0) + p.numel()
    units = [sum(p.numel() for p in spec.params) for spec in plan_units(model) if spec.params]
    return counts, units


def comm_bytes_per_step(plan, stage: int, counts: dict[str, int], world_size: int) -> tuple[float, float]:
    """(buffer bytes per step, bytes one rank sends per step) for the stage, from the plan's dtypes."""
    buffer = sent = 0.0
    share = (world_size - 1) / world_size
    for group, numel in counts.items():
        role = plan.groups[group]
        reduce = numel * _size(role.reduce_dtype)
        if stage == 0:
            buffer += reduce
            sent += 2 * share * reduce
            continue
        gather = numel * (_size(role.param_dtype) if stage < 3 else 2 * _size(role.gather_dtype))
        buffer += reduce + gather
        # Stage 1 all-reduces (zeroshard/sharding/stages.py): twice a reduce-scatter's bytes sent.
        sent += share * ((2 if stage == 1 else 1) * reduce + gather)
    return buffer, sent


def project(config: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per (model, stage, world size): the estimator's bytes and the comm volume."""
    rows = []
    for model_name in MODEL_SHAPES:
        for stage in range(4):
            cfg_raw = json.loads(json.dumps(config))
            cfg_raw.setdefault("zero_optimization", {})["stage"] = stage
            for world in WORLD_SIZES:
                cfg = resolve_config(cfg_raw, world_size=world)
                plan = resolve_precision_plan(cfg)
                counts, units = _model_facts(model_name, plan)
                est = estimate_for_config(cfg, plan, counts, world_size=world, unit_numels=units)
                buffer, sent = comm_bytes_per_step(plan, stage, counts, world)
                rows.append({
                    "model": model_name, "num_params": sum(counts.values()), "stage": stage,
                    "world_size": world, "model_state_bytes": est.model_state_bytes,
                    "buffer_bytes": est.buffer_bytes, "total_bytes": est.total_bytes,
                    "comm_buffer_bytes_per_step": buffer, "comm_sent_bytes_per_rank": sent,
                })
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    """Two tables: memory per rank by world size, and communication per step."""
    out = ["Memory per rank, GiB: model states + bounded buffers (zeroshard.tools.memory.estimate_for_config)\n",
           "| model | params | stage | " + " | ".join(f"W={w}" for w in WORLD_SIZES) + " |",
           "|---|--:|--:|" + "--:|" * len(WORLD_SIZES)]
    for model in MODEL_SHAPES:
        for stage in range(4):
            cells = [r for r in rows if r["model"] == model and r["stage"] == stage]
            n = cells[0]["num_params"]
            vals = " | ".join(
                f"{r['model_state_bytes'] / GIB:.1f} + {r['buffer_bytes'] / GIB:.1f}" for r in cells
            )
            out.append(f"| {model} | {n / 1e9:.2f}B | {stage} | {vals} |")
    out += ["", "Communication per optimizer step (no accumulation), GiB: collective buffers; "
            "sent by one rank at W=8 and W=1024 (ring)\n",
            "| model | stage 0 | stage 1-2 | stage 3 | sent/rank s0 (W=8 / 1024) | sent/rank s3 (W=8 / 1024) |",
            "|---|--:|--:|--:|--:|--:|"]
    def pick(model: str, stage: int, world: int) -> dict[str, Any]:
        return next(r for r in rows if r["model"] == model and r["stage"] == stage and r["world_size"] == world)

    for model in MODEL_SHAPES:
        b = [pick(model, s, 8)["comm_buffer_bytes_per_step"] / GIB for s in (0, 1, 3)]
        s0 = [pick(model, 0, w)["comm_sent_bytes_per_rank"] / GIB for w in (8, 1024)]
        s3 = [pick(model, 3, w)["comm_sent_bytes_per_rank"] / GIB for w in (8, 1024)]
        out.append(f"| {model} | {b[0]:.1f} | {b[1]:.1f} | {b[2]:.1f} | {s0[0]:.1f} / {s0[1]:.1f} "
                   f"| {s3[0]:.1f} / {s3[1]:.1f} |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Project memory per rank and communication per step.")
    p.add_argument("--config", default=None, help="a DeepSpeed-format JSON config (default: bf16, AdamW)")
    p.add_argument("--json", action="store_true", help="print the rows as JSON instead of Markdown")
    args = p.parse_args(argv)
    config = json.loads(Path(args.config).read_text()) if args.config else DEFAULT_CONFIG
    rows = project(config)
    sys.stdout.write(json.dumps(rows, indent=1) + "\n" if args.json else markdown(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
