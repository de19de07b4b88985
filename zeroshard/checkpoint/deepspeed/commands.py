"""`zeroshard from-deepspeed SRC DST` and `zeroshard to-deepspeed SRC DST` (registered by zeroshard/cli.py)."""

from __future__ import annotations

import argparse
import sys
from typing import Any


def add_commands(sub: Any) -> None:
    src_help = "the save directory (its 'latest' names the tag) or one tag's directory"
    from_ds = sub.add_parser(
        "from-deepspeed",
        help="convert a DeepSpeed checkpoint (ZeRO 0-3 or universal) into a zeroshard checkpoint",
        description="Read a checkpoint DeepSpeed 0.19 saved (any ZeRO stage, fp32/bf16/fp16, any world size, or "
        "ds_to_universal output) without DeepSpeed installed, and write it as zeroshard checkpoint DST/<tag>, "
        "which loads on any world size and stage. engine.load_checkpoint(SRC) reads SRC directly, too.",
    )
    from_ds.add_argument("source", metavar="SRC", help=src_help)
    from_ds.add_argument("dest", metavar="DST", help="the zeroshard save directory to write into")
    from_ds.add_argument("--tag", help="which checkpoint of SRC (default: the one 'latest' names)")
    from_ds.add_argument("--allow-pickle", action="store_true",
                         help="build any Python object the files name (runs code from them: trusted files only)")
    from_ds.set_defaults(handler=_run_from_deepspeed)
    to_ds = sub.add_parser(
        "to-deepspeed",
        help="write a zeroshard checkpoint as one DeepSpeed 0.19's load_checkpoint resumes",
        description="Write zeroshard checkpoint SRC as DeepSpeed checkpoint DST/<tag> (Adam/AdamW state), for "
        "--stage and --world-size (default: the ones the checkpoint records).",
    )
    to_ds.add_argument("source", metavar="SRC", help=src_help)
    to_ds.add_argument("dest", metavar="DST", help="the DeepSpeed save directory to write into")
    to_ds.add_argument("--tag", help="which checkpoint of SRC (default: the one 'latest' names)")
    to_ds.add_argument("--stage", type=int, choices=(0, 1, 2, 3), help="the ZeRO stage DeepSpeed will run")
    to_ds.add_argument("--world-size", type=int, help="the data-parallel world size DeepSpeed will run")
    to_ds.add_argument("--allow-pickle", action="store_true",
                       help="read a python_state.pt holding arbitrary objects (runs code: trusted files only)")
    to_ds.set_defaults(handler=_run_to_deepspeed)


def _run_from_deepspeed(args: argparse.Namespace) -> int:
    from zeroshard.checkpoint.base import CheckpointError
    from zeroshard.checkpoint.deepspeed.convert import from_deepspeed

    try:
        path = from_deepspeed(args.source, args.dest, tag=args.tag, allow_pickle=args.allow_pickle)
    except (CheckpointError, OSError) as exc:
        print(f"zeroshard from-deepspeed: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {path}")
    return 0


def _run_to_deepspeed(args: argparse.Namespace) -> int:
    from zeroshard.checkpoint.base import CheckpointError
    from zeroshard.checkpoint.deepspeed.convert import to_deepspeed

    try:
        path = to_deepspeed(args.source, args.dest, tag=args.tag, stage=args.stage, world_size=args.world_size,
                            allow_pickle=args.allow_pickle)
    except (CheckpointError, OSError) as exc:
        print(f"zeroshard to-deepspeed: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {path}")
    return 0
