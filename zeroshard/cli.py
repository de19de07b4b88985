"""The `zeroshard` command: explain (zeroshard.tools.explain), simulate (zeroshard.tools.simulate), demo,
to-fp32 (zeroshard.checkpoint),
from-deepspeed / to-deepspeed (zeroshard.checkpoint.deepspeed), report (zeroshard.tools.report),
launch (zeroshard.launch.torchrun), install-deepspeed-alias (zeroshard.tools.deepspeed_alias).

`zeroshard explain CONFIG` prints what a config resolves to: the precision of every tensor role
per parameter group, the defaults it applied, the keys accepted with no effect, and the per-rank
memory estimate. A bad config exits with status 2 and one message naming the key.
"""

from __future__ import annotations

import argparse
import json
import sys

from zeroshard.checkpoint.deepspeed.commands import add_commands as add_deepspeed_commands
from zeroshard.tools.explain import ConfigError, UsageError, explain_data, preset_names, print_tables

EXIT_OK = 0
EXIT_USAGE = 2  # bad config or bad arguments, as argparse does



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
        data = explain_data(
            args.config, args.world_size, args.model, args.params, hf_config=args.hf_config, seq=args.seq,
            micro_batch=args.micro_batch, activation_checkpointing=args.activation_checkpointing, device=args.device,
        )
    except ConfigError as exc:
        print(f"zeroshard explain: {args.config}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except UsageError as exc:
        print(f"zeroshard explain: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        print_tables(data)
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
    presets = preset_names()
    source = explain.add_mutually_exclusive_group()
    source.add_argument(
        "--model",
        metavar="PRESET|module:factory",
        help="the model: its parameters per precision group, and each rank's peak memory traced on fake tensors"
        + (f" (presets: {', '.join(presets)})" if presets else ""),
    )
    source.add_argument("--hf-config", metavar="PATH", help="a Hugging Face config.json (or its folder): the model "
                        "built from it, without weights")
    source.add_argument("--params", type=_positive_int, metavar="N",
                        help="estimate model states and buffer bounds for N parameters (no activations)")
    explain.add_argument("--seq", type=_positive_int, metavar="S",
                         help="tokens per sample (default: the model's longest)")
    explain.add_argument("--micro-batch", type=_positive_int, metavar="M",
                         help="samples per micro-step (default: the config's train_micro_batch_size_per_gpu)")
    explain.add_argument("--activation-checkpointing", action="store_true",
                         help="each unit recomputes its activations in backward (torch.utils.checkpoint)")
    explain.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                         help="where it trains: an accelerator (default) or the CPU (one memory)")
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
    add_deepspeed_commands(sub)
    report = sub.add_parser(
        "report",
        help="draw PNG plots of a run from its CSV monitor files",
        description="Plot loss and learning rate, the step-time breakdown and the expert load "
        "of a run from the CSV files under RUN_DIR (a csv_monitor's output). Exits 1 when there is "
        "nothing to plot.",
    )
    report.add_argument("run_dir", metavar="RUN_DIR", help="directory holding the run's CSV files")
    report.add_argument("--out", metavar="DIR", help="where to write the PNGs (default: RUN_DIR)")
    report.set_defaults(handler=_run_report)
    alias = sub.add_parser(
        "install-deepspeed-alias",
        help="make `import deepspeed` give zeroshard in this environment (for the Trainer, Accelerate, TRL)",
        description="Install a distribution named `deepspeed` (version 0.19.8+zeroshard) whose modules are "
        "zeroshard's, so Hugging Face transformers, Accelerate and TRL find and drive zeroshard, and the `deepspeed` "
        "launcher command (one node, through torchrun). Refuses when a "
        "real DeepSpeed is installed. Undo with --uninstall (or `pip uninstall deepspeed`).",
    )
    alias.add_argument("--target", metavar="DIR", help="install into DIR instead of this environment's site-packages")
    alias.add_argument("--uninstall", action="store_true", help="remove the alias")
    alias.set_defaults(handler=_run_install_deepspeed_alias)
    from zeroshard.tools.simulate import add_command as add_simulate_command

    add_simulate_command(sub, _positive_int)
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
    except (CheckpointError, OSError) as exc:  # a bad checkpoint, or an output that cannot be written
        print(f"zeroshard to-fp32: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {path}")
    return EXIT_OK


def _run_report(args: argparse.Namespace) -> int:
    from zeroshard.tools.report import ReportError, write_report

    try:
        paths = write_report(args.run_dir, args.out)
    except ReportError as exc:
        print(f"zeroshard report: {exc}", file=sys.stderr)
        return 1
    for path in paths:
        print(f"wrote {path}")
    return EXIT_OK


def _run_install_deepspeed_alias(args: argparse.Namespace) -> int:
    from zeroshard.tools.deepspeed_alias import VERSION, AliasError, default_target, install, uninstall

    target = args.target or default_target()
    try:
        if args.uninstall:
            removed = uninstall(target)
            print(f"removed the deepspeed alias from {target}" if removed else f"no deepspeed alias in {target}")
        else:
            package = install(args.target)  # None: the command goes to this environment's scripts folder
            print(f"installed deepspeed {VERSION} (zeroshard) at {package}")
    except (AliasError, OSError) as exc:
        print(f"zeroshard install-deepspeed-alias: {exc}", file=sys.stderr)
        return 1
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
        from zeroshard.launch.torchrun import main as launch_main

        return launch_main(argv[1:])
    args = build_parser().parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    raise SystemExit(main())
