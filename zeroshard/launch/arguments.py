"""`add_config_arguments`: the command-line flags a DeepSpeed script adds to its parser."""

from __future__ import annotations

import argparse

__all__ = ["add_config_arguments"]


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add DeepSpeed's flags to `parser` and return it, as `deepspeed.add_config_arguments`.

    `--deepspeed_config PATH` is what `initialize(args=...)` reads (`--deepscale_config`, the
    old name, too); `--deepspeed` and `--deepscale` are flags for the script's own use.
    """
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="Flag for the script's own use (zeroshard does not read it).")
    group.add_argument("--deepspeed_config", default=None, type=str, help="The JSON (or HJSON) config file.")
    group.add_argument("--deepscale", default=False, action="store_true", help="Old name of --deepspeed.")
    group.add_argument("--deepscale_config", default=None, type=str, help="Old name of --deepspeed_config.")
    return parser
