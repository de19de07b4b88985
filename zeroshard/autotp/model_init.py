"""`deepspeed.tp_model_init(model, tp_size, dtype, config=None, **kwargs)`, as DeepSpeed 0.19.8
has it: it only records the arguments (the model is returned unchanged); the next `initialize`
merges them into the config's `tensor_parallel` section and splits the model there.

The Hugging Face Trainer calls it (transformers' `deepspeed_init`, when the config's
`tensor_parallel.autotp_size` is above 1) right before `deepspeed.initialize`.

Merge rules (DeepSpeed's `merge_tp_model_init_into_config`): the config is the canonical
source; a key it lacks is filled from the record; a conflicting `autotp_size`, `tp.tp_size`,
`dtype` (against the config's bf16/fp16 or `tensor_parallel.dtype`) or `tp_group` is an error.
A `tp_group` must be the group zeroshard builds (consecutive ranks), since the layout, not a
caller, owns the ranks. Unlike DeepSpeed's, the record is used by one `initialize` and then
dropped, so a later engine in the same process (a test, a second job) does not inherit it; the
Trainer records again before each `initialize`.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import torch

from zeroshard.comm import collectives as comm

__all__ = ["tp_model_init", "merge_recorded_tp_model_init", "TpModelInitError"]

_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "fp16": torch.float16, "float16": torch.float16,
           "half": torch.float16, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}


class TpModelInitError(ValueError):
    """tp_model_init's arguments disagree with the config, or with an earlier call."""


class _Record:
    """The arguments of the last `tp_model_init`, until an `initialize` uses them."""

    args: dict[str, Any] | None = None


def tp_model_init(model: torch.nn.Module, tp_size: int, dtype: torch.dtype, config: Any = None,
                  **kwargs: Any) -> torch.nn.Module:
    """Record tensor-parallel arguments for the next `initialize` (DeepSpeed 0.19.8's signature and
    behaviour: nothing is split here). Returns `model` unchanged.

    Args:
        model: the model (returned as it is).
        tp_size: the tensor-parallel size (`tensor_parallel.autotp_size`).
        dtype: the model's dtype; must agree with the config's precision.
        config: accepted, as DeepSpeed accepts it (the config passed to `initialize` counts).
        tp_group: optional keyword: a process group of `tp_size` ranks, which must be the one
            zeroshard builds (this rank's block of consecutive ranks).

    Raises:
        TpModelInitError: a second call with other arguments before `initialize`.
    """
    if not isinstance(tp_size, int) or isinstance(tp_size, bool) or tp_size < 1:
        raise TpModelInitError(f"tp_model_init: tp_size={tp_size!r} must be a positive integer.")
    unknown = sorted(set(kwargs) - {"tp_group"})
    if unknown:
        raise TpModelInitError(f"tp_model_init: unexpected keyword argument(s) {unknown}; DeepSpeed takes tp_group.")
    new = {"tp_size": tp_size, "dtype": dtype, "tp_group": kwargs.get("tp_group")}
    old = _Record.args
    if old is not None and (old["tp_size"], old["dtype"]) != (tp_size, dtype):
        raise TpModelInitError(
            "tp_model_init: conflicting arguments across calls (tp_size "
            f"{old['tp_size']} then {tp_size}, dtype {old['dtype']} then {dtype}). Call it once per model."
        )
    _Record.args = new
    return model


def _config_dtype(config: dict[str, Any]) -> torch.dtype | None:
    for key, dtype in (("bf16", torch.bfloat16), ("bfloat16", torch.bfloat16), ("fp16", torch.float16)):
        section = config.get(key)
        if isinstance(section, dict) and section.get("enabled", False):
            return dtype
    return None


def _check_group(group: Any, tp_size: int) -> None:
    """A caller's tp_group must be this rank's block of `tp_size` consecutive ranks."""
    ranks = tuple(comm.as_group(group).ranks)
    me = comm.rank()
    expected = tuple(range(me // tp_size * tp_size, me // tp_size * tp_size + tp_size))
    if ranks != expected:
        raise TpModelInitError(
            f"tp_model_init: tp_group has ranks {list(ranks)}; zeroshard places tensor-parallel groups on consecutive "
            f"ranks ({list(expected)} for rank {me}, DeepSpeed's placement). Pass no tp_group, or that group."
        )


def merge_recorded_tp_model_init(raw: Any, mpu: Any = None) -> Any:
    """`raw` (a config dict or path) with the recorded tp_model_init arguments merged in, and the
    record dropped; `raw` unchanged when there is none. The caller's dict is not modified."""
    args, _Record.args = _Record.args, None
    if args is None:
        return raw
    from zeroshard.config.file import read_config_file

    config = copy.deepcopy(read_config_file(Path(raw)) if isinstance(raw, (str, os.PathLike)) else dict(raw))
    tp_size, dtype, group = args["tp_size"], args["dtype"], args["tp_group"]
    if group is not None and mpu is not None:
        raise TpModelInitError("tp_model_init was given tp_group: initialize must not be given mpu as well.")
    section = config.get("tensor_parallel")
    section = dict(section) if isinstance(section, dict) else {}
    size = section.get("autotp_size")
    if size is not None and size != tp_size:
        raise TpModelInitError(
            f"tensor_parallel.autotp_size={size} in the config, tp_model_init(tp_size={tp_size}): they conflict. "
            "Make them agree, or drop autotp_size from the config."
        )
    section["autotp_size"] = tp_size
    tp = section.get("tp", section.get("tensor_parallel")) or {}
    if not isinstance(tp, dict):
        raise TpModelInitError("tensor_parallel.tp must be an object when given.")
    if tp.get("tp_size") not in (None, tp_size):
        raise TpModelInitError(
            f"tensor_parallel.tp.tp_size={tp['tp_size']} in the config, tp_model_init(tp_size={tp_size}): they "
            "conflict. Make them agree, or drop it."
        )
    if group is not None:
        _check_group(group, tp_size)
    configured = _config_dtype(config)
    if configured is not None and configured != dtype:
        raise TpModelInitError(
            f"tp_model_init(dtype={dtype}) but the config trains in {configured}. Make them agree."
        )
    written = section.get("dtype")
    if written is not None and _DTYPES.get(str(written).lower().removeprefix("torch.")) not in (None, dtype):
        raise TpModelInitError(f"tensor_parallel.dtype={written!r} in the config, tp_model_init(dtype={dtype}): "
                               "they conflict. Make them agree, or drop it.")
    config["tensor_parallel"] = section
    return config
