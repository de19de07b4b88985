"""The `zeroshard` command: explain (here), demo, to-fp32 (zeroshard.checkpoint), launch (zeroshard.launch).

`zeroshard explain CONFIG` prints what a config resolves to: the precision of every tensor role
per parameter group, the defaults it applied, the keys accepted with no effect, and the per-rank
memory estimate. A bad config exits with status 2 and one message naming the key.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import warnings
from collections.abc import Callable
from typing import Any

from zeroshard.config import ConfigError, ZeroshardConfig, load_config
from zeroshard.memory import MemoryEstimate, bytes_per_param, estimate_for_config, optimizer_state_count
from zeroshard.precision import PrecisionPlan, assign_param_groups, resolve_precision_plan

EXIT_OK = 0
EXIT_USAGE = 2  # bad config or bad arguments, as argparse does

ROLE_ROWS = (
    ("param", "module parameters"),
    ("compute", "compute"),
    ("grad", "gradient (autograd)"),
    ("grad_accum", "gradient accumulation"),
    ("reduce", "reduce (wire)"),
    ("gather", "all-gather (wire)"),
    ("master", "master weights"),
    ("optimizer_state", "optimizer state"),
)
# How many parameter names per group the table shows (JSON lists them all).
_NAMES_SHOWN = 6


class UsageError(Exception):
    """A bad command-line argument (exit status 2)."""


# ---------------------------------------------------------------------------------------------
# Models for --model
# ---------------------------------------------------------------------------------------------


def _preset_names() -> list[str]:
    try:
        from zeroshard.demo.model import PRESETS
    except ImportError:
        return []
    return list(PRESETS)


def build_model_on_meta(spec: str) -> Any:
    """Build ``spec`` on the meta device: shapes without memory.

    Args:
        spec: a demo preset name (``tiny``, ``small``, ``gpt2-124m``, ...) or ``module:factory``,
            where ``factory()`` (a function or class, called without arguments) returns an
            ``nn.Module``.

    Raises:
        UsageError: when the spec does not name a preset or an importable factory.
    """
    import torch
    from torch import nn

    if ":" in spec:
        module_name, _, attr = spec.partition(":")
        if "" not in sys.path and "." not in sys.path:
            sys.path.insert(0, "")  # as `python -m` does, so a module in the working directory imports
        try:
            factory = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as exc:
            raise UsageError(f"--model {spec}: cannot import {attr!r} from {module_name!r} ({exc}).") from None
        build: Callable[[], Any] = factory
    else:
        try:
            from zeroshard.demo.model import GPT, PRESETS
        except ImportError as exc:
            raise UsageError(f"--model {spec}: the demo model presets are unavailable ({exc}).") from None
        if spec not in PRESETS:
            raise UsageError(
                f"--model {spec}: unknown preset; use one of {', '.join(PRESETS)}, or module:factory."
            )

        def build() -> Any:
            return GPT(PRESETS[spec])

    with torch.device("meta"):
        model = build()
    if not isinstance(model, nn.Module):
        raise UsageError(f"--model {spec}: the factory returned {type(model).__name__}, not an nn.Module.")
    return model


def _unit_numels(model: Any, config: ZeroshardConfig) -> list[int] | None:
    """Element counts of the engine's units for this model, if the engine's unit rule is importable."""
    try:
        from zeroshard.units import plan_units
    except ImportError:
        return None
    extras = config.zeroshard
    specs = plan_units(model, extras.unit_module_classes, extras.unit_min_params)
    return [sum(p.numel() for p in spec.params) for spec in specs if spec.params]


# ---------------------------------------------------------------------------------------------
# explain
# ---------------------------------------------------------------------------------------------


def _model_report(model: Any, plan: PrecisionPlan) -> dict[str, Any]:
    groups = assign_param_groups(plan, model)
    params = dict(model.named_parameters())
    report: dict[str, Any] = {"num_params": sum(p.numel() for p in params.values()), "groups": {}}
    for group in plan.groups:
        names = [name for name, g in groups.items() if g == group]
        report["groups"][group] = {
            "num_params": sum(params[n].numel() for n in names),
            "num_tensors": len(names),
            "params": names,
        }
    return report


def explain_data(
    config_path: str,
    world_size: int,
    model_spec: str | None = None,
    num_params: int | None = None,
) -> dict[str, Any]:
    """Everything `zeroshard explain` shows, as a JSON-ready dict.

    Raises:
        ConfigError: for a bad config; UsageError: for a bad model spec.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # explain lists the no-effect keys itself
        config = load_config(config_path, world_size=world_size)
    plan = resolve_precision_plan(config)
    data: dict[str, Any] = {
        "config": str(config_path),
        "world_size": world_size,
        "zero_stage": config.zero_optimization.stage,
        "batch": {
            "train_batch_size": config.train_batch_size,
            "train_micro_batch_size_per_gpu": config.train_micro_batch_size_per_gpu,
            "gradient_accumulation_steps": config.gradient_accumulation_steps,
            "derived": list(config.derived_keys),
        },
        "optimizer": config.optimizer.type if config.optimizer else None,
        "precision": plan.as_dict(),
        "defaults_applied": list(config.defaults_applied),
        "no_effect_keys": list(config.no_effect_keys),
        "model": None,
    }
    estimate: MemoryEstimate | None = None
    if model_spec is not None:
        model = build_model_on_meta(model_spec)
        data["model"] = {"spec": model_spec, **_model_report(model, plan)}
        counts = {g: info["num_params"] for g, info in data["model"]["groups"].items()}
        units = _unit_numels(model, config)
        if units is not None:
            data["model"]["units"] = {"count": len(units), "largest_numel": max(units, default=0)}
        estimate = estimate_for_config(config, plan, counts, unit_numels=units)
        if config.optimizer is not None and config.optimizer.type.lower() == "muon":
            from zeroshard.optim.muon import muon_param_plan

            choices = muon_param_plan(model, config.optimizer.params)
            data["model"]["muon"] = {
                "muon": [c.name for c in choices if c.use_muon],
                "adamw": [c.name for c in choices if not c.use_muon],
                "reasons": {c.name: c.reason for c in choices},
            }
    elif num_params is not None:
        estimate = estimate_for_config(config, plan, num_params)
    states = optimizer_state_count(
        config.optimizer.type if config.optimizer else None, config.optimizer.params if config.optimizer else None
    )
    per_param = {}
    for group in plan.groups:
        replicated, sharded = bytes_per_param(plan, config.zero_optimization.stage, states, group)
        per_param[group] = {"replicated": replicated, "sharded": sharded}
    data["memory"] = {
        "bytes_per_param": per_param,
        "estimate": estimate.as_dict() if estimate else None,
    }
    return data


def _human(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(nbytes) < 1024 or unit == "TiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.2f} {unit}"
        nbytes /= 1024
    raise AssertionError("unreachable")


def _print_tables(data: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    precision = data["precision"]
    batch = data["batch"]
    console.print(
        f"[bold]{data['config']}[/bold]: ZeRO stage {data['zero_stage']}, world size {data['world_size']}, "
        f"precision mode [bold]{precision['mode']}[/bold]"
    )
    derived = f" ({', '.join(batch['derived'])} derived)" if batch["derived"] else ""
    console.print(
        f"batch: train_batch_size {batch['train_batch_size']} = micro {batch['train_micro_batch_size_per_gpu']}"
        f" x accumulation {batch['gradient_accumulation_steps']} x world {data['world_size']}{derived}"
    )

    table = Table(title="Precision plan (dtype per tensor role and parameter group)")
    table.add_column("role")
    groups = precision["groups"]
    model = data["model"]
    for group in groups:
        header = group
        if model is not None:
            header += f"\n{model['groups'][group]['num_params']:,} params"
        table.add_column(header)
    for key, label in ROLE_ROWS:
        table.add_row(label, *(str(groups[g][key]) for g in groups))
    scale = precision["loss_scale"]
    scale_text = scale["kind"]
    if scale["kind"] in ("dynamic", "grad_scaler"):
        scale_text += f" (init {scale['init_scale']:g}, window {scale['window']}, hysteresis {scale['hysteresis']})"
    elif scale["kind"] == "static":
        scale_text += f" ({scale['init_scale']:g})"
    table.add_row("loss scaling", *([scale_text] * len(groups)))
    console.print(table)
    console.print(f"skip steps with non-finite gradients: {precision['check_grad_overflow']}")
    for note in precision["notes"]:
        console.print(f"note: {note}")

    if model is not None:
        console.print(f"\nmodel [bold]{model['spec']}[/bold]: {model['num_params']:,} parameters")
        for group, info in model["groups"].items():
            names = info["params"]
            shown = ", ".join(names[:_NAMES_SHOWN])
            if len(names) > _NAMES_SHOWN:
                shown += f", ... ({len(names)} tensors)"
            console.print(f"  {group}: {info['num_params']:,} ({shown or 'none'})")
        if "units" in model:
            console.print(f"  units: {model['units']['count']}, largest {model['units']['largest_numel']:,} elements")
        if "muon" in model:
            muon_table = Table(title="Muon: which optimizer each parameter gets")
            muon_table.add_column("parameter")
            muon_table.add_column("optimizer")
            muon_table.add_column("why")
            for name, reason in model["muon"]["reasons"].items():
                kind = "Muon" if name in model["muon"]["muon"] else "AdamW"
                muon_table.add_row(name, kind, reason)
            console.print(muon_table)

    memory = data["memory"]
    estimate = memory["estimate"]
    if estimate is None:
        console.print("\nmodel-state bytes per parameter on each rank (P parameters, W ranks):")
        for group, coeff in memory["bytes_per_param"].items():
            console.print(f"  {group}: {coeff['replicated']} * P + {coeff['sharded']} * P / W")
        console.print("  (give --model or --params for a full estimate with buffers)")
    else:
        mem = Table(title=f"Per-rank memory estimate ({estimate['num_params']:,} params, W={estimate['world_size']})")
        mem.add_column("component")
        mem.add_column("bytes", justify="right")
        for key, value in estimate["model_states"].items():
            mem.add_row(key, _human(value))
        mem.add_row("[bold]model states[/bold]", f"[bold]{_human(estimate['model_state_bytes'])}[/bold]")
        for key, value in estimate["buffers"].items():
            if value:
                mem.add_row(f"{key} (bound)", _human(value))
        mem.add_row("[bold]total[/bold]", f"[bold]{_human(estimate['total_bytes'])}[/bold]")
        console.print(mem)
        for assumption in estimate["assumptions"]:
            console.print(f"assumed: {assumption}")

    console.print("\ndefaults applied: " + (", ".join(data["defaults_applied"]) or "none"))
    console.print("accepted, no effect: " + (", ".join(data["no_effect_keys"]) or "none"))


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


def _run_explain(args: argparse.Namespace) -> int:
    try:
        data = explain_data(args.config, args.world_size, args.model, args.params)
    except ConfigError as exc:
        print(f"zeroshard explain: {args.config}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except UsageError as exc:
        print(f"zeroshard explain: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        _print_tables(data)
    return EXIT_OK


# ---------------------------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="zeroshard",
        description="ZeRO sharded data-parallel training for PyTorch with a precision policy you can read.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    explain = sub.add_parser(
        "explain",
        help="show the resolved precision plan, defaults and memory estimate of a config",
        description="Show what a DeepSpeed-style config resolves to. Exits 2 on a bad config.",
    )
    explain.add_argument("config", metavar="CONFIG", help="DeepSpeed-style JSON config file")
    presets = _preset_names()
    explain.add_argument(
        "--model",
        metavar="PRESET|module:factory",
        help="count parameters per precision group, built on the meta device"
        + (f" (presets: {', '.join(presets)})" if presets else ""),
    )
    explain.add_argument("--params", type=_positive_int, metavar="N", help="estimate memory for N parameters")
    explain.add_argument("--world-size", type=_positive_int, default=1, metavar="N", help="ranks (default 1)")
    explain.add_argument("--json", action="store_true", help="print JSON instead of tables")
    explain.set_defaults(handler=_run_explain)
    sub.add_parser(
        "demo",
        help="train a small GPT on the standard library's source (see `zeroshard demo --help`)",
        add_help=False,
    )
    to_fp32 = sub.add_parser(
        "to-fp32",
        help="consolidate a sharded checkpoint into one fp32 state dict (safetensors)",
        description="Write the full fp32 state dict of a zeroshard checkpoint, with the model's own "
        "parameter names (tied ones under each name) and buffers: model.load_state_dict(strict=True) takes it.",
    )
    to_fp32.add_argument("checkpoint", metavar="CKPT_DIR", help="the save directory (or one tag's directory)")
    to_fp32.add_argument("output", metavar="OUT", help="output file (.safetensors; another suffix: torch.save)")
    to_fp32.add_argument("--tag", help="which checkpoint (default: the one 'latest' names)")
    to_fp32.set_defaults(handler=_run_to_fp32)
    sub.add_parser(
        "launch",
        help="run a training script with torchrun (see `zeroshard launch --help`)",
        add_help=False,
    )
    return parser


def _run_to_fp32(args: argparse.Namespace) -> int:
    from zeroshard.checkpoint import CheckpointError, write_fp32

    try:
        path = write_fp32(args.checkpoint, args.output, tag=args.tag)
    except CheckpointError as exc:
        print(f"zeroshard to-fp32: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {path}")
    return EXIT_OK


def _run_demo(argv: list[str]) -> int:
    from zeroshard.demo.cli import main as demo_main

    return demo_main(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the `zeroshard` command; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "demo":
        # Everything after `demo` belongs to the demo's own parser (its --help included).
        return _run_demo(argv[1:])
    if argv and argv[0] == "launch":
        from zeroshard.launch import main as launch_main

        return launch_main(argv[1:])
    args = build_parser().parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    raise SystemExit(main())
