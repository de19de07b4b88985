"""The demo's training script: one process per rank, started by torchrun.

    python -m torch.distributed.run --standalone --nproc_per_node 2 -m zeroshard.demo.train --steps 300

It uses zeroshard exactly as a user's DeepSpeed-style script would: `initialize`, then
`engine(x, y)`, `engine.backward(loss)`, `engine.step()`. Run it again with the same --run-dir
and it resumes from the last checkpoint.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
import torch.distributed as dist

from zeroshard.comm import collectives as comm
from zeroshard.comm.deepspeed_api import init_distributed
from zeroshard.config.file import read_config_file
from zeroshard.demo.data import DEFAULT_MAX_BYTES, ByteWindows, build_datasets, stdlib_root
from zeroshard.demo.monitoring import LOGGED_LOSS_EVENT, csv_folder, with_monitoring, write_report_pngs
from zeroshard.demo.plot import read_metrics, write_loss_plot
from zeroshard.demo.progress import ProgressReporter
from zeroshard.engine.initialize import initialize
from zeroshard.models import PRESETS, build_gpt
from zeroshard.resolve import resolve_config
from zeroshard.sharding.layout import current_layout

DEFAULT_STEPS = 300
DEFAULT_MODEL = "small"
SAMPLE_PROMPT = b"def "


def default_config(total_steps: int, on_gpu: bool) -> dict:
    """The embedded DeepSpeed-style config: ZeRO stage 2, AdamW, warmup then cosine decay.

    fp32 on CPU (CPU bf16 matmuls are slow and the point there is to watch it learn);
    bf16 on GPUs.
    """
    config = {
        "train_micro_batch_size_per_gpu": 16,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": 3e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.01},
        },
        "scheduler": {
            "type": "WarmupCosineLR",
            "params": {
                "total_num_steps": total_steps,
                "warmup_num_steps": max(1, min(30, total_steps // 10)),
                "warmup_type": "linear",
                "cos_min_ratio": 0.1,
            },
        },
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 2},
    }
    if on_gpu:
        config["bf16"] = {"enabled": True}
    return config


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="zeroshard.demo.train", description="Train a byte-level GPT on the stdlib's source."
    )
    parser.add_argument("--config", help="DeepSpeed-style JSON config (default: the embedded one)")
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="stop at this optimizer step")
    parser.add_argument("--model", default=DEFAULT_MODEL, choices=sorted(PRESETS), help="model size preset")
    parser.add_argument("--run-dir", default="runs/demo", help="metrics, plot, checkpoints go here")
    parser.add_argument("--seed", type=int, default=1337)
    parser.add_argument("--sample-tokens", type=int, default=200, help="bytes to generate at the end")
    parser.add_argument("--eval-every", type=int, default=50, help="validation loss every N steps")
    parser.add_argument("--eval-windows", type=int, default=128, help="validation windows per evaluation")
    parser.add_argument("--checkpoint-every", type=int, default=100, help="checkpoint every N steps (and at the end)")
    parser.add_argument("--corpus-bytes", type=int, default=DEFAULT_MAX_BYTES, help="corpus size cap")
    add_moe_arguments(parser)
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps={args.steps}: must be at least 1")
    return args


def add_moe_arguments(parser: argparse.ArgumentParser) -> None:
    """The MoE options (each block's MLP becomes an MoE layer; see GPTConfig.moe_*)."""
    parser.add_argument("--moe-experts", type=int, default=0, help="experts per MoE layer (0: dense MLPs)")
    parser.add_argument("--moe-ep-size", type=int, default=1, help="ranks the experts are spread over")
    parser.add_argument("--moe-k", type=int, default=1, help="experts per token")


def moe_overrides(args: argparse.Namespace) -> dict:
    if not args.moe_experts:
        return {}
    return {"moe_num_experts": args.moe_experts, "moe_ep_size": args.moe_ep_size, "moe_k": args.moe_k}


class RunDirMismatch(ValueError):
    """The run directory holds a run of another model size."""


def check_run_dir(run_dir: Path, model: str) -> None:
    """Refuse to resume a run of another model size: its checkpoint would not fit."""
    run_file = run_dir / "run.json"
    if run_file.exists():
        previous = json.loads(run_file.read_text())["model"]
        if previous != model:
            raise RunDirMismatch(
                f"{run_dir} holds a run of model '{previous}', not '{model}': pass --model {previous} "
                "to resume it, or --run-dir NEW_DIR to start another run."
            )


def all_ranks_mean(value: torch.Tensor) -> float:
    """Mean of a scalar over all ranks."""
    value = value.detach().float().clone()
    world = current_layout().world
    comm.all_reduce(value, group=world, tag="demo")
    return value.item() / world.size


@torch.no_grad()
def evaluate(engine, val_data: ByteWindows, num_windows: int) -> float:
    """Mean validation loss over `num_windows` windows spread evenly through the validation
    text (the same ones every time), shared out across ranks."""
    rank, world = dist.get_rank(), dist.get_world_size()
    batch_size = engine.train_micro_batch_size_per_gpu()
    num_windows = min(num_windows, len(val_data))
    picked = [i * len(val_data) // num_windows for i in range(num_windows)]
    mine = picked[rank::world]
    loss_sum = torch.zeros((), device=engine.device)
    count = torch.zeros((), device=engine.device)
    engine.eval()
    for start in range(0, len(mine), batch_size):
        pairs = [val_data[i] for i in mine[start : start + batch_size]]
        x = torch.stack([x for x, _ in pairs]).to(engine.device)
        y = torch.stack([y for _, y in pairs]).to(engine.device)
        loss = engine(x, y)[1]
        loss_sum += loss.float() * len(pairs)
        count += len(pairs)
    engine.train()
    comm.all_reduce(loss_sum, group=engine.layout.world, tag="demo")
    comm.all_reduce(count, group=engine.layout.world, tag="demo")
    return (loss_sum / count).item()


@torch.no_grad()
def generate_sample(engine, num_bytes: int, seed: int) -> str:
    """A sample continuing SAMPLE_PROMPT. Every rank generates the same bytes (same seed), so a
    stage-3 config, whose forward gathers parameters collectively, works too."""
    engine.eval()
    prompt = torch.tensor([list(SAMPLE_PROMPT)], dtype=torch.long, device=engine.device)
    generator = torch.Generator().manual_seed(seed)
    out = engine.module.generate(prompt, num_bytes, temperature=0.8, top_k=50, generator=generator)
    engine.train()
    return bytes(out[0].tolist()).decode("utf-8", errors="replace")


def precision_plan_text(config_path: Path, world_size: int, model: str, plan) -> str:
    """What `zeroshard explain CONFIG --model MODEL --world-size W` prints: the precision plan
    per parameter group and the memory estimate. Falls back to the engine's plan as text."""
    from zeroshard.tools.explain import ConfigError, UsageError, explain_text

    device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        text = explain_text(str(config_path), world_size, model, device=device)
    except (ConfigError, UsageError):
        return f"engine.precision_plan = {plan}"
    return f"$ zeroshard explain {config_path} --model {model} --world-size {world_size} --device {device}\n\n{text}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    init_distributed()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    run_dir = Path(args.run_dir)
    check_run_dir(run_dir, args.model)
    ckpt_dir = run_dir / "checkpoints"
    config_path = Path(args.config) if args.config else run_dir / "ds_config.json"
    metrics_path = run_dir / "metrics.jsonl"

    # Same seed on every rank: every rank builds the same initial weights.
    torch.manual_seed(args.seed)
    model = build_gpt(args.model, **moe_overrides(args))
    train_data, val_data = build_datasets(model.config.block_size, args.corpus_bytes)
    on_gpu = torch.cuda.is_available()
    base_config = read_config_file(config_path) if args.config else default_config(args.steps, on_gpu)
    # csv_monitor into the run dir and the step timers: `zeroshard report`'s PNGs at the end.
    config = with_monitoring(base_config, run_dir)
    engine, optimizer, loader, scheduler = initialize(
        model=model, model_parameters=model.parameters(), config=config, training_data=train_data
    )
    if len(loader) == 0:
        raise SystemExit("the data loader yields no batches: lower train_micro_batch_size_per_gpu.")

    # Resume from the last checkpoint when there is one.
    resumed, client_state = False, {}
    if (ckpt_dir / "latest").exists():
        path, loaded_state = engine.load_checkpoint(str(ckpt_dir))
        resumed, client_state = path is not None, loaded_state or {}
    start_step = engine.global_steps
    # A fresh shuffle on resume: the sampler's order for the interrupted epoch is not replayed.
    epoch = client_state.get("epoch", -1) + 1
    elapsed_before = client_state.get("elapsed_s", 0.0)

    tokens_per_step = (
        engine.train_micro_batch_size_per_gpu()
        * engine.gradient_accumulation_steps()
        * world_size
        * model.config.block_size
    )
    resolved = resolve_config(config, world_size=world_size)
    progress = ProgressReporter(start_step, args.steps, enabled=rank == 0, print_every=resolved.steps_per_print)
    progress.print(
        f"[bold]zeroshard demo[/]: model '{args.model}' ({model.num_params() / 1e6:.2f}M params), "
        f"{world_size} processes on {engine.device.type}, ZeRO stage {resolved.zero_optimization.stage}, "
        f"precision {engine.precision_plan.mode}\n"
        f"corpus: {len(train_data.data) / 1e6:.1f} MB train + {len(val_data.data) / 1e6:.2f} MB validation "
        f"of Python source from {stdlib_root()}\n"
        f"{tokens_per_step:,} tokens per step; run dir {run_dir}"
    )
    if resumed:
        progress.print(f"resuming from step {start_step} (checkpoint in {ckpt_dir})")

    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "run.json").write_text(json.dumps({"model": args.model}) + "\n")
        if not args.config:  # the embedded config, written out so `zeroshard explain` can read it
            # Without the monitoring sections: they name this run dir, and a run started from
            # this file with another --run-dir should write its CSV files there.
            (run_dir / "ds_config.json").write_text(json.dumps(base_config, indent=2) + "\n")
        # Keep exactly the records up to the step training starts from: on a fresh start the
        # file begins empty; on resume, records past the checkpoint (a run that crashed) go.
        kept = [r for r in read_metrics(metrics_path) if r["step"] <= start_step] if resumed else []
        metrics_path.write_text("".join(json.dumps(r) + "\n" for r in kept))

    def save_checkpoint() -> None:
        engine.save_checkpoint(
            str(ckpt_dir),
            client_state={
                "step": engine.global_steps,
                "epoch": epoch,
                "elapsed_s": elapsed_before + time.perf_counter() - t_start,
            },
        )

    t_start = time.perf_counter()
    t_last = t_start
    train_seconds = 0.0  # time in training steps this run, for the average tokens/s shown
    average_tokens_per_s = 0.0
    window_loss = torch.zeros((), device=engine.device)  # sum of micro-batch losses this step
    window_micro = 0
    with progress:
        while engine.global_steps < args.steps:
            sampler = getattr(loader, "sampler", None)
            if hasattr(sampler, "set_epoch"):
                sampler.set_epoch(epoch)
            for x, y in loader:
                # Pinned batches (the engine's loader on CUDA): the copies do not block the host.
                x, y = x.to(engine.device, non_blocking=True), y.to(engine.device, non_blocking=True)
                loss = engine(x, y)[1]
                engine.backward(loss)
                step_before, samples_before = engine.global_steps, engine.global_samples
                engine.step()
                window_loss += loss.detach().float()
                window_micro += 1
                if engine.global_steps == step_before:
                    continue  # inside a gradient-accumulation window

                # One optimizer step finished: report it.
                step = engine.global_steps
                loss_value = all_ranks_mean(window_loss / window_micro)
                window_loss.zero_()
                window_micro = 0
                # At the engine's train_loss index (samples before the step), as DeepSpeed's.
                engine.monitor.write_events([(LOGGED_LOSS_EVENT, loss_value, samples_before)])
                now = time.perf_counter()
                tokens_per_s = tokens_per_step / (now - t_last)
                train_seconds += now - t_last
                average_tokens_per_s = (step - start_step) * tokens_per_step / train_seconds
                grad_norm = engine.get_global_grad_norm()
                record = {
                    "step": step,
                    "loss": loss_value,
                    "lr": engine.get_lr()[0],
                    "grad_norm": None if grad_norm is None else float(grad_norm),
                    "tokens_per_s": tokens_per_s,
                    "tokens": step * tokens_per_step,
                    "elapsed_s": elapsed_before + now - t_start,
                }
                if step % args.eval_every == 0 or step == args.steps:
                    record["val_loss"] = evaluate(engine, val_data, args.eval_windows)
                    progress.print(f"step {step}: validation loss {record['val_loss']:.4f}")
                if rank == 0:
                    with metrics_path.open("a") as f:
                        f.write(json.dumps(record) + "\n")
                progress.update(step, loss_value, average_tokens_per_s, record["lr"])
                if not math.isfinite(loss_value):
                    raise SystemExit(f"loss is {loss_value} at step {step}: training diverged.")
                if args.checkpoint_every > 0 and step % args.checkpoint_every == 0 and step < args.steps:
                    save_checkpoint()
                t_last = time.perf_counter()  # evaluation and checkpoints do not count as tokens/s
                if step >= args.steps:
                    break
            epoch += 1

    if engine.global_steps > start_step:
        save_checkpoint()
    else:
        progress.print(f"already at step {start_step}: pass a larger --steps to train on")

    sample = generate_sample(engine, args.sample_tokens, args.seed)
    if rank == 0:
        records = read_metrics(metrics_path)
        write_loss_plot(records, run_dir / "loss.png", title=f"zeroshard demo: {args.model}")
        plan_text = precision_plan_text(config_path, world_size, args.model, engine.precision_plan)
        (run_dir / "precision_plan.txt").write_text(plan_text)
        (run_dir / "sample.txt").write_text(sample + "\n")
        engine.monitor.flush()  # the CSV files complete on disk before the report reads them
        csv_dir = csv_folder(resolved)
        report_pngs, no_report = write_report_pngs(csv_dir, run_dir)
        if records:
            first, last = records[0], records[-1]
            speed = f"; {average_tokens_per_s:,.0f} tokens/s on average this run" if train_seconds else ""
            progress.print(
                f"\nloss {first['loss']:.3f} (step {first['step']}) -> {last['loss']:.3f} "
                f"(step {last['step']}); {last['elapsed_s']:.0f} s of training in all{speed}"
            )
        progress.print("[bold]sample:[/]")
        progress.print(sample, markup=False, highlight=False)
        outputs = ["metrics.jsonl", "loss.png", *(p.name for p in report_pngs), "precision_plan.txt", "sample.txt"]
        progress.print(f"\nrun dir {run_dir}: {', '.join(outputs)}, checkpoints/")
        if report_pngs:
            progress.print(
                f"report ({', '.join(p.name for p in report_pngs)}) drawn from the csv_monitor files in {csv_dir}"
            )
        else:
            progress.print(f"no report PNGs: {no_report}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
