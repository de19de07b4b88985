"""Parsing the small fields of a checkpoint before anything is written into the engine.

Loading is all-or-nothing (load.py): every value the write phase uses is parsed and checked
here first, so a field of the wrong type (`counters.global_steps` of `null` or `"7x"`) is a
CheckpointError naming the file and the field while the engine is still untouched, never a
TypeError halfway through the writes.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from zeroshard.checkpoint.base import CheckpointError
from zeroshard.checkpoint.validate import is_int

COUNTERS = ("global_steps", "micro_steps", "skipped_steps")


def field_error(path: Path | str, field: str, value: Any, rule: str) -> CheckpointError:
    return CheckpointError(f"{path}: field {field} = {value!r}: {rule}; the checkpoint is corrupt or was edited.")


def _is_number(value: Any) -> bool:
    return (is_int(value) or isinstance(value, float)) and math.isfinite(value)


def parse_counters(index: dict[str, Any], path: Path) -> dict[str, int]:
    """`counters`: the three step counters, each a non-negative integer (and, when recorded,
    the accumulation they were counted with and the samples seen)."""
    counters = index.get("counters")
    if not isinstance(counters, dict):
        raise field_error(path, "counters", counters, "must be a table of step counters")
    out = {}
    for key in COUNTERS:
        value = counters.get(key)
        if not is_int(value) or value < 0:
            raise field_error(path, f"counters.{key}", value, "must be a non-negative integer")
        out[key] = value
    accumulation = counters.get("gradient_accumulation_steps")  # absent before it was kept
    if accumulation is not None:
        if not is_int(accumulation) or accumulation < 1:
            raise field_error(path, "counters.gradient_accumulation_steps", accumulation, "must be a positive integer")
        out["gradient_accumulation_steps"] = accumulation
    samples = counters.get("global_samples")  # absent in checkpoints written before it was kept
    if samples is not None:
        if not is_int(samples) or samples < 0:
            raise field_error(path, "counters.global_samples", samples, "must be a non-negative integer")
        out["global_samples"] = samples
    return out


def parse_sampler(index: dict[str, Any], path: Path) -> dict[str, Any] | None:
    """`data_sampler`: None, or a table whose `epoch`, if present, is a non-negative integer."""
    sampler = index.get("data_sampler")
    if sampler is None:
        return None
    if not isinstance(sampler, dict):
        raise field_error(path, "data_sampler", sampler, "must be a table or null")
    if "epoch" in sampler and not (is_int(sampler["epoch"]) and sampler["epoch"] >= 0):
        raise field_error(path, "data_sampler.epoch", sampler["epoch"], "must be a non-negative integer")
    return sampler


def _check_like(saved: Any, current: Any, path: Path | str, field: str, require_keys: bool) -> None:
    """`saved` has the shape of `current` (a state_dict this engine produced): numbers where it has
    numbers, strings where strings, containers where containers, recursively through tables."""
    if isinstance(current, bool):
        ok = isinstance(saved, bool)
    elif is_int(current) or isinstance(current, float):
        ok = _is_number(saved) or (isinstance(current, float) and isinstance(saved, float))  # inf/nan kept
    elif isinstance(current, str):
        ok = isinstance(saved, str)
    elif isinstance(current, (list, tuple)):
        ok = isinstance(saved, (list, tuple))
    elif isinstance(current, dict):
        if not isinstance(saved, dict):
            raise field_error(path, field, saved, "must be a table")
        for key, value in current.items():
            if key not in saved:
                if require_keys:
                    raise field_error(path, f"{field}.{key}", None, "is missing")
                continue
            _check_like(saved[key], value, path, f"{field}.{key}", require_keys)
        return
    else:
        return  # None or an object: nothing known to compare with
    if not ok:
        raise field_error(path, field, saved, f"must be a {type(current).__name__} like this run's")


def check_scaler_state(saved: Any, scaler: Any, path: Path) -> dict[str, Any] | None:
    """`loss_scaler`: a table with a `kind`; of this run's kind, every field this scaler has."""
    if saved is None:
        return None
    if not isinstance(saved, dict) or not isinstance(saved.get("kind"), str):
        raise field_error(path, "loss_scaler", saved, "must be a table with a string 'kind'")
    current = scaler.state_dict()
    if saved["kind"] == current.get("kind"):
        _check_like(saved, current, path, "loss_scaler", require_keys=True)
        if "scale" in saved and not (_is_number(saved["scale"]) and saved["scale"] > 0):
            raise field_error(path, "loss_scaler.scale", saved["scale"], "must be a positive finite number")
    return saved


def check_scheduler_state(saved: Any, scheduler: Any, where: str) -> dict[str, Any]:
    """The scheduler's state: a table whose fields have the types of this scheduler's own.

    Fields this scheduler lacks or the checkpoint lacks are left to its `load_state_dict`
    (another torch version may add some); a field of another type is refused.
    """
    if not isinstance(saved, dict):
        raise field_error(where, "lr_scheduler", saved, "must be a table (the scheduler's state_dict)")
    _check_like(saved, scheduler.state_dict(), where, "lr_scheduler", require_keys=False)
    return saved


# Which kernel an optimizer runs (fused, foreach) is this run's choice, not a hyper-parameter to
# restore: an offloaded engine steps on the host with the fused CPU kernel, another may not.
KERNEL_KEYS = frozenset({"fused", "foreach"})


def check_param_groups(saved: Any, optimizer: Any, path: Path) -> list[dict[str, Any]]:
    """`optimizer.param_groups`: one table per group, hyper-parameters typed like this run's."""
    if not isinstance(saved, list):
        raise field_error(path, "optimizer.param_groups", saved, "must be a list")
    for i, entry in enumerate(saved):
        field = f"optimizer.param_groups[{i}]"
        if not isinstance(entry, dict) or not isinstance(entry.get("hyper"), dict):
            raise field_error(path, field, entry, "must be a table with a 'hyper' table")
        tuple_keys = entry.get("tuple_keys", [])
        if not isinstance(tuple_keys, list) or not all(isinstance(k, str) for k in tuple_keys):
            raise field_error(path, f"{field}.tuple_keys", tuple_keys, "must be a list of names")
        group = optimizer.param_groups[i] if i < len(optimizer.param_groups) else {}
        for key, value in entry["hyper"].items():
            if key in KERNEL_KEYS:
                continue
            current = group.get(key)
            if hasattr(current, "numel") and current.numel() == 1:  # a tensor lr
                current = current.item()
            if key in tuple_keys and not isinstance(value, list):
                raise field_error(path, f"{field}.hyper.{key}", value, "must be a list (saved from a tuple)")
            if current is not None:
                _check_like(value, current, path, f"{field}.hyper.{key}", require_keys=False)
    return saved


def scalar_value(value: Any, kind: Any, where: str, field: str) -> Any:
    """A 0-d optimizer state read back, converted to what the optimizer held (`kind`)."""
    if kind not in ("tensor", "float", "int", "bool"):
        raise field_error(where, field, kind, "kind must be one of tensor, float, int, bool")
    if not hasattr(value, "numel") or value.numel() != 1:  # save writes only one-element tensors
        raise field_error(where, field, list(getattr(value, "shape", [])), "must hold one element")
    if kind == "tensor":
        return value.clone()
    return {"float": float, "int": int, "bool": bool}[kind](value.item())
