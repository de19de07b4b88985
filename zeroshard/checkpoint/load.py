"""Loading a checkpoint into an engine of any world size and stage.

Two phases, so that nothing is half-loaded:

1. *Read*: every rank validates the checkpoint against the model (names, shapes, files,
   checksums of every file it will read, the optimizer's state kinds), and reads what is
   small: buffers, frozen parameters, counters, scaler and scheduler state, RNG state. The
   engine is not touched. The ranks then agree: if any rank failed, every rank raises.
2. *Write*: flat by flat, assemble the master weights (and the optimizer state) in this
   engine's layout from whichever saved fragments overlap (the saving run's world size, stage
   and padding do not matter), copy them into the engine and drop them, so the host holds one
   flat's share at a time, not the rank's (docs/memory.md); the files were checked in phase 1,
   so only an I/O error can stop it half-way. Then republish the module parameters from the
   masters (stages 0-2: the full buffers; stage 3: `param_shard`, or nothing where the next
   gather casts the master), cast to the parameter dtype.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import pickle
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from zeroshard.autotp.split import TensorSplit, tensor_split_of
from zeroshard.checkpoint.async_save import wait_for_checkpoint
from zeroshard.checkpoint.deepspeed.convert import converted, deepspeed_tag_dir, universal_latest
from zeroshard.checkpoint.fields import (
    KERNEL_KEYS,
    check_param_groups,
    check_scaler_state,
    check_scheduler_state,
    parse_counters,
    parse_sampler,
    scalar_value,
)
from zeroshard.checkpoint.format import (
    EXTRAS_FILE,
    INDEX_FILE,
    MASTER_KIND,
    PYTHON_STATE_FILE,
    CheckpointError,
    CheckpointReader,
    find_tag_dir,
    rank_file_name,
    read_latest,
    state_kind,
    validate_tag,
)
from zeroshard.checkpoint.frozen import frozen_values
from zeroshard.checkpoint.names import flat_names, model_param_shapes, saved_offset
from zeroshard.checkpoint.rng import RNG_PREFIX, RngState, apply_rng_state, parse_rng_state
from zeroshard.checkpoint.save import module_names
from zeroshard.checkpoint.sync import agree, all_gather_object, describe, is_rank_zero
from zeroshard.sharding.ranges import overlap
from zeroshard.step.publish import publish_masters

logger = logging.getLogger("zeroshard")


@dataclass
class LoadOptions:
    optimizer_states: bool = True
    lr_scheduler_states: bool = True
    module_only: bool = False
    allow_pickle: bool = False


@dataclass
class _Loaded:
    """Everything phase 1 read, ready to be written into the engine."""

    tag_dir: Path
    masters: list[Callable[[], torch.Tensor]]  # each flat's, read when it is written (phase 2)
    # Values copied straight into module tensors: frozen parameters and buffers, by name.
    module_values: dict[str, torch.Tensor]
    optimizer_states: list[Callable[[], dict[str, Any]]] | None = None
    reader: CheckpointReader | None = None  # open until phase 2 has read every flat
    param_groups: list[dict[str, Any]] | None = None
    lr_only: bool = False  # restore just the lrs (scheduler state loaded, optimizer state not)
    counters: dict[str, int] | None = None
    loss_scaler: dict[str, Any] | None = None
    lr_scheduler: dict[str, Any] | None = None
    data_sampler: dict[str, Any] | None = None
    rng: RngState | None = None
    client_state: Any = field(default_factory=dict)


# ------------------------------------------------------------------ checks and reads


def _model_differences(engine: Any, index: dict[str, Any]) -> list[str]:
    """Every way the checkpoint's parameters and buffers differ from the model's."""
    module = engine.module
    model_params = model_param_shapes(module)
    aliases, _, buffer_names = module_names(engine)
    buffers = dict(module.named_buffers(remove_duplicate=False))
    model_buffers = {name: list(buffers[name].shape) for name in buffer_names}
    saved_params = {name: entry["shape"] for name, entry in index["params"].items()}
    saved_aliases = index.get("aliases", {})
    saved_params.update(
        {alias: saved_params[target] for alias, target in saved_aliases.items() if target in saved_params}
    )
    saved_params.update({name: e["shape"] for name, e in index.get("frozen_params", {}).items()})
    saved_buffers = {name: e["shape"] for name, e in index.get("buffers", {}).items()}
    problems = []
    for what, model, saved in (("parameter", model_params, saved_params), ("buffer", model_buffers, saved_buffers)):
        missing = sorted(set(model) - set(saved))
        unexpected = sorted(set(saved) - set(model))
        if missing:
            problems.append(f"{what}s of the model missing from the checkpoint: {', '.join(missing)}")
        if unexpected:
            problems.append(f"{what}s in the checkpoint that the model lacks: {', '.join(unexpected)}")
        for name in sorted(set(model) & set(saved)):
            if list(model[name]) != list(saved[name]):
                problems.append(f"{what} {name}: shape {saved[name]} in the checkpoint, {model[name]} in the model")
    if saved_aliases != aliases:
        problems.append(f"tied parameters differ: checkpoint {saved_aliases}, model {aliases}")
    return problems


def _check_extras(
    engine: Any, extras: dict[str, torch.Tensor], buffer_names: list[str], reader: CheckpointReader
) -> None:
    """The extras file holds every buffer and frozen parameter the model will take from it, in
    the model's shapes (the index said so; the file must agree, or phase 2's copy would fail)."""
    module = engine.module
    # Frozen parameters are saved whole by checkpoint name (experts by global name, AutoEP
    # stacks in their global shape: checkpoint/frozen.py), so compare with the saved shapes.
    shapes = model_param_shapes(module)
    buffers = dict(module.named_buffers(remove_duplicate=False))
    shapes.update({name: list(buffers[name].shape) for name in buffer_names})
    wanted = list(buffer_names) + [n for n in reader.index.get("frozen_params", {}) if n in shapes]
    path = reader.tag_dir / EXTRAS_FILE
    for name in wanted:
        if name not in extras:
            raise CheckpointError(f"{path}: tensor {name!r} missing; {INDEX_FILE} lists it.")
        if list(extras[name].shape) != list(shapes[name]):
            raise CheckpointError(
                f"{path}: tensor {name!r} has shape {list(extras[name].shape)}, the model's is "
                f"{list(shapes[name])}; the file does not match {INDEX_FILE}."
            )


def _param_source(reader: CheckpointReader, extras: dict[str, torch.Tensor]):
    """A function (name, kind, start, length, split) -> 1-D tensor reading the saved parameter:
    elements of the whole tensor, or of this rank's tensor-parallel piece `split` of it
    (whatever tensor-parallel size saved it: format.CheckpointReader.read_for)."""

    def read(name: str, kind: str, start: int, length: int, split: TensorSplit | None = None) -> torch.Tensor:
        if name in reader.index["params"]:
            return reader.read_for(name, kind, start, length, split)
        if kind != MASTER_KIND:
            raise CheckpointError(
                f"parameter {name} was frozen when the checkpoint was saved, so it has no optimizer "
                "state: load with load_optimizer_states=False."
            )
        whole = extras[name] if split is None else split.piece_of(extras[name])
        return whole.reshape(-1)[start : start + length]

    return read


def _assemble(flat: Any, names: list[str], read, kind: str, dtype: torch.dtype) -> torch.Tensor:
    """The `kind` tensor of `flat` (its parameters saved under `names`) in this engine's master
    layout, from the saved fragments."""
    master_start, master_len = flat.master_range()
    out = torch.zeros(master_len, dtype=dtype)
    for i, name in enumerate(names):
        common = overlap(flat.offsets[i], flat.offsets[i] + flat.numels[i], master_start, master_start + master_len)
        if common is not None:
            lo, hi = common
            start = lo - flat.offsets[i] + saved_offset(flat.params[i])
            piece = read(name, kind, start, hi - lo, tensor_split_of(flat.params[i]))
            out[lo - master_start : hi - master_start].copy_(piece)
    return out


def _flat_optimizer_state(
    engine: Any, flat: Any, names: list[str], reader: CheckpointReader, read
) -> Callable[[], dict[str, Any]]:
    """Checks the flat's saved optimizer state now; the returned function reads it (phase 2)."""
    params = reader.index["params"]
    entries = [params.get(name) for name in names]
    if any(e is None for e in entries):
        missing = [n for n, e in zip(names, entries, strict=True) if e is None]
        raise CheckpointError(
            f"parameters {missing} were frozen when the checkpoint was saved, so they have no optimizer "
            "state: load with load_optimizer_states=False."
        )
    elementwise = entries[0]["optimizer_state"]
    scalars = entries[0]["optimizer_scalars"]
    for name, entry in zip(names, entries, strict=True):
        if entry["optimizer_state"] != elementwise or entry["optimizer_scalars"] != scalars:
            raise CheckpointError(
                f"parameters {names[0]} and {name} share a flat buffer here but had different "
                "optimizer state kinds when saved; load with load_optimizer_states=False."
            )
    current = engine.optimizer.state.get(flat.master, {})
    dtypes = {}
    for key in elementwise:
        # The dtype the optimizer already keeps this state in, else the saved one.
        existing = current.get(key)
        saved = reader.saved_dtype(names[0], state_kind(key))
        dtypes[key] = existing.dtype if isinstance(existing, torch.Tensor) else saved
    scalar_values = {}
    for key, kind in scalars.items():  # 0-d: read and checked now
        value = reader.read_scalar(names, key)
        if value is None:  # only empty parameters here: any other flat's copy
            value = reader.read_scalar(list(params), key)
        scalar_values[key] = scalar_value(value, kind, str(reader.tag_dir), f"optimizer scalar {key}")

    def state() -> dict[str, Any]:
        out: dict[str, Any] = {key: _assemble(flat, names, read, state_kind(key), dtype)
                               for key, dtype in dtypes.items()}
        out.update(scalar_values)
        return out

    return state


# Optimizer classes that keep the same state under the same names (AdamW's moments kept in
# another dtype by StateDtypeAdamW; DeepSpeed's Muon state converted by from-deepspeed): a
# checkpoint of one loads into the other.
_OPTIMIZER_FAMILIES = {"StateDtypeAdamW": "AdamW", "ShardedMuon": "Muon"}


def optimizer_class(optimizer: Any) -> str:
    """The class a checkpoint names for `optimizer`: DeepSpeedCPUAdam keeps Adam's or
    AdamW's state, as its mode says (zeroshard/optim/cpu_adam.py)."""
    return getattr(optimizer, "checkpoint_class", type(optimizer).__name__)


def _optimizer_family(class_name: str) -> str:
    return _OPTIMIZER_FAMILIES.get(class_name, class_name)


def _python_state(reader: CheckpointReader, allow_pickle: bool) -> dict[str, Any]:
    """python_state.pt, unpickled with torch's weights-only unpickler unless `allow_pickle`.

    The weights-only unpickler builds only dicts, lists, tuples, sets, numbers, strings and
    tensors, so a crafted file cannot make loading run code; any other object needs the
    caller's explicit `allow_pickle=True`.
    """
    path = reader.verify_file(PYTHON_STATE_FILE)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        if not allow_pickle:
            first_line = str(error).strip().splitlines()[-1] if str(error).strip() else ""
            raise CheckpointError(
                f"{path}: holds Python objects other than dicts, lists, tuples, numbers, strings and "
                f"tensors ({first_line}); loading them would run code from the checkpoint, so "
                "load_checkpoint refuses. If you trust this checkpoint, pass "
                "load_checkpoint(..., allow_pickle=True)."
            ) from None
        try:
            state = torch.load(path, map_location="cpu", weights_only=False)
        except Exception as error2:
            raise CheckpointError(f"{path}: unreadable ({error2}).") from None
    except Exception as error:
        raise CheckpointError(f"{path}: unreadable ({error}).") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: holds a {type(state).__name__}, not the dict save_checkpoint writes.")
    return state


def _entry_value(
    reader: CheckpointReader, entry: dict[str, Any] | None, key: str, cache: dict, options: LoadOptions
) -> Any:
    if entry is None:
        return None
    if "json" in entry:
        return entry["json"]
    if "python" not in cache:
        cache["python"] = _python_state(reader, options.allow_pickle)
    if key not in cache["python"]:
        raise CheckpointError(f"{reader.tag_dir / PYTHON_STATE_FILE}: has no {key!r}, which {INDEX_FILE} puts there.")
    return cache["python"][key]


def read_for_engine(engine: Any, tag_dir: Path, options: LoadOptions) -> _Loaded:
    """Phase 1: validate everything, read what is small. Touches nothing. The returned `_Loaded`
    holds the open reader (phase 2 reads the flats through it; `load_checkpoint` closes it)."""
    reader = CheckpointReader(tag_dir)
    try:
        loaded = _read(engine, reader, tag_dir, options)
    except BaseException:
        reader.close()
        raise
    loaded.reader = reader
    return loaded


def _needed_files(engine: Any, reader: CheckpointReader, saved_names: list[list[str]]) -> set[str]:
    """The rank files holding a fragment of this rank's masters (opened, so checked, in phase 1)."""
    params = reader.index["params"]
    files = set()
    for flat, names in zip(engine.flats, saved_names, strict=True):
        master_start, master_len = flat.master_range()
        for i, name in enumerate(names):
            common = overlap(flat.offsets[i], flat.offsets[i] + flat.numels[i], master_start, master_start + master_len)
            if common is None or name not in params:
                continue
            start = common[0] - flat.offsets[i] + saved_offset(flat.params[i])
            stop = start + common[1] - common[0]
            for frag in params[name]["fragments"]:
                if overlap(start, stop, frag["offset"], frag["offset"] + frag["numel"]) is not None:
                    files.add(rank_file_name(frag["rank"]))
    return files


def _read(engine: Any, reader: CheckpointReader, tag_dir: Path, options: LoadOptions) -> _Loaded:
    index = reader.index
    problems = _model_differences(engine, index)
    if problems:
        raise CheckpointError(f"checkpoint {tag_dir} does not match the model:\n  " + "\n  ".join(problems))
    extras = reader.extras()
    read = _param_source(reader, extras)
    saved_names = flat_names(engine)
    masters = [
        functools.partial(_assemble, flat, names, read, MASTER_KIND, flat.master.dtype)
        for flat, names in zip(engine.flats, saved_names, strict=True)
    ]
    for file_name in sorted(_needed_files(engine, reader, saved_names)):
        reader.open(file_name)  # checks size, checksum, rank and lengths now (phase 1)
    _, frozen_now, buffer_names = module_names(engine)
    _check_extras(engine, extras, buffer_names, reader)
    module_values = {name: extras[name] for name in buffer_names}

    def saved_whole(name: str) -> torch.Tensor | None:  # frozen now; maybe trainable (sharded) when saved
        if name in extras:
            return extras[name]
        return reader.read_full(name) if name in index["params"] else None

    module_values.update(frozen_values(engine.module, frozen_now, saved_whole))
    loaded = _Loaded(tag_dir=tag_dir, masters=masters, module_values=module_values)
    if options.module_only:
        return loaded  # client state is never read: a module-only load reads tensors and JSON only
    cache: dict[str, Any] = {}
    loaded.client_state = _entry_value(reader, index.get("client_state"), "client_state", cache, options) or {}

    saved_opt = index.get("optimizer")
    wants_groups = options.optimizer_states or options.lr_scheduler_states
    if engine.optimizer is not None and saved_opt is not None and wants_groups:
        if len(saved_opt["param_groups"]) != len(engine.optimizer.param_groups):
            raise CheckpointError(
                f"checkpoint {tag_dir}: {len(saved_opt['param_groups'])} optimizer param groups saved, "
                f"this engine has {len(engine.optimizer.param_groups)}; load with "
                "load_optimizer_states=False and load_lr_scheduler_states=False."
            )
        if options.optimizer_states:
            if _optimizer_family(saved_opt["class"]) != _optimizer_family(optimizer_class(engine.optimizer)):
                raise CheckpointError(
                    f"checkpoint {tag_dir}: optimizer state of {saved_opt['class']}, this engine uses "
                    f"{optimizer_class(engine.optimizer)}; load with load_optimizer_states=False."
                )
            loaded.optimizer_states = [
                _flat_optimizer_state(engine, f, names, reader, read)
                for f, names in zip(engine.flats, saved_names, strict=True)
            ]
            loaded.param_groups = saved_opt["param_groups"]
        elif options.lr_scheduler_states:
            loaded.param_groups, loaded.lr_only = saved_opt["param_groups"], True
    if options.lr_scheduler_states and engine.lr_scheduler is not None:
        loaded.lr_scheduler = _entry_value(reader, index.get("lr_scheduler"), "lr_scheduler", cache, options)
    _parse_small_fields(engine, reader, loaded)
    return loaded


def _parse_small_fields(engine: Any, reader: CheckpointReader, loaded: _Loaded) -> None:
    """Check every non-tensor value phase 2 will use (fields.py), so phase 2 cannot fail on one."""
    index, path = reader.index, reader.tag_dir / INDEX_FILE
    loaded.counters = parse_counters(index, path)
    loaded.data_sampler = parse_sampler(index, path)
    loaded.loss_scaler = check_scaler_state(index.get("loss_scaler"), engine.loss_scaler, path)
    if loaded.param_groups is not None:
        check_param_groups(loaded.param_groups, engine.optimizer, path)
    if loaded.lr_scheduler is not None:
        where = str(path if "json" in (index.get("lr_scheduler") or {}) else reader.tag_dir / PYTHON_STATE_FILE)
        check_scheduler_state(loaded.lr_scheduler, engine.lr_scheduler, where)
    rank = engine.global_rank
    if rank < index["world_size"]:
        tensors, metadata = reader.rank_file_tensors(rank, RNG_PREFIX), reader.rank_file_metadata(rank)
        loaded.rng = parse_rng_state(tensors, metadata, str(reader.tag_dir / rank_file_name(rank)))


# --------------------------------------------------------------------------- writes


def _restore_param_groups(optimizer: torch.optim.Optimizer, saved: list[dict[str, Any]], lr_only: bool) -> None:
    for group, entry in zip(optimizer.param_groups, saved, strict=True):
        for key, value in entry["hyper"].items():
            if (lr_only and key not in ("lr", "initial_lr")) or key in KERNEL_KEYS:
                continue
            if key in ("name", "moe"):  # which parameters a group holds, this run's (e.g. ep_size_4)
                continue
            if key in entry["tuple_keys"]:
                value = tuple(value)
            current = group.get(key)
            if isinstance(current, torch.Tensor):
                current.fill_(value)
            else:
                group[key] = value


def _load_small_states(engine: Any, loaded: _Loaded) -> None:
    """Scaler and scheduler: the loads that can raise; undone together if one does."""
    scaler, scheduler = engine.loss_scaler, engine.lr_scheduler
    scaler_before = scaler.state_dict()
    scheduler_before = scheduler.state_dict() if loaded.lr_scheduler is not None else None
    try:
        if loaded.loss_scaler is not None:
            if loaded.loss_scaler.get("kind") == scaler_before.get("kind"):
                scaler.load_state_dict(loaded.loss_scaler)
            else:
                logger.warning(
                    "load_checkpoint: loss scaling was %r when saved and is %r now (precision mode "
                    "changed); keeping this run's fresh scaler.",
                    loaded.loss_scaler.get("kind"),
                    scaler_before.get("kind"),
                )
        if loaded.lr_scheduler is not None:
            scheduler.load_state_dict(loaded.lr_scheduler)
    except Exception as error:
        scaler.load_state_dict(scaler_before)
        if scheduler_before is not None:
            scheduler.load_state_dict(scheduler_before)
        raise CheckpointError(
            f"checkpoint {loaded.tag_dir}: loss scaler / scheduler state rejected: {error}"
        ) from error


def _write_into_engine(engine: Any, loaded: _Loaded) -> None:
    module = engine.module
    with torch.no_grad():
        # One flat at a time: its master (and state) are read, written and dropped before the next.
        for k, (flat, master) in enumerate(zip(engine.flats, loaded.masters, strict=True)):
            flat.load_master(master())
            if loaded.optimizer_states is not None:
                flat.load_optimizer_state(engine.optimizer, loaded.optimizer_states[k]())
        if loaded.param_groups is not None:
            _restore_param_groups(engine.optimizer, loaded.param_groups, loaded.lr_only)
        # A collective at stages 1-2 (same flats, same order on every rank).
        publish_masters(engine.flats, engine.config.zero_optimization.allgather_bucket_size)
        for flat in engine.flats:
            flat.free_full()  # stage 3: a gathered copy would be stale; the next use re-gathers
        tensors = dict(module.named_parameters(remove_duplicate=False))
        tensors.update(module.named_buffers(remove_duplicate=False))
        for name, value in loaded.module_values.items():
            tensors[name].copy_(value.to(tensors[name].device))


def resumed_micro_steps(counters: dict[str, int], accumulation: int) -> int:
    """The micro-step position a load restores: the accumulation windows completed before the
    save, in this run's accumulation, so a resumed run starts at a boundary whatever the world
    size and `gradient_accumulation_steps` now (a window saved half-way is dropped: its gradients
    were never saved). A checkpoint that does not record its accumulation counts its windows by
    `global_steps` (one per boundary)."""
    saved = counters.get("gradient_accumulation_steps")
    windows = counters["micro_steps"] // saved if saved else counters["global_steps"]
    return windows * accumulation


def apply_to_engine(engine: Any, loaded: _Loaded, options: LoadOptions) -> None:
    """Phase 2: write what phase 1 read into the engine and republish the parameters."""
    if not options.module_only:
        _load_small_states(engine, loaded)
    _write_into_engine(engine, loaded)
    if options.module_only:
        return
    if loaded.counters is not None:
        engine.global_steps = loaded.counters["global_steps"]
        engine.micro_steps = resumed_micro_steps(loaded.counters, engine.config.gradient_accumulation_steps)
        engine.skipped_steps = loaded.counters["skipped_steps"]
        # DeepSpeed's fallback for a checkpoint without it: a train batch per step.
        engine.global_samples = loaded.counters.get(
            "global_samples", engine.global_steps * engine.config.train_batch_size
        )
    sampler = getattr(getattr(engine, "training_dataloader", None), "sampler", None)
    if loaded.data_sampler is not None and "epoch" in loaded.data_sampler and hasattr(sampler, "set_epoch"):
        sampler.set_epoch(loaded.data_sampler["epoch"])
    if loaded.rng is not None:
        apply_rng_state(loaded.rng)
    engine.zero_grad()  # gradients accumulated before the load belong to other weights


# ---------------------------------------------------------------------------- entry


def load_checkpoint(
    engine: Any,
    load_dir: str | os.PathLike,
    tag: str | None = None,
    load_optimizer_states: bool = True,
    load_lr_scheduler_states: bool = True,
    load_module_only: bool = False,
    allow_pickle: bool = False,
) -> tuple[str | None, Any]:
    """Load a checkpoint saved on any world size and stage; collective.

    Nothing in the checkpoint directory is executed: tensors come from safetensors files,
    everything else from JSON or from `python_state.pt` through torch's weights-only
    unpickler. A `python_state.pt` holding other Python objects (a `client_state` with
    your own classes) is refused unless `allow_pickle=True`, which unpickles it fully and
    so runs whatever code it names: pass it only for checkpoints you trust.
    `load_module_only=True` never reads client state (it returns `{}` for it).

    Returns:
        (checkpoint directory, client_state), or (None, None) when `tag` is None and
        `load_dir` has no `latest` file (nothing saved yet), as DeepSpeed does.
    """
    load_dir = Path(load_dir)
    wait_for_checkpoint(f"load_checkpoint({load_dir}, tag={tag!r})")  # it may be the one to load
    options = LoadOptions(load_optimizer_states, load_lr_scheduler_states, load_module_only, allow_pickle)
    loaded: _Loaded | None = None
    error: BaseException | None = None
    if tag is None:  # DeepSpeed's ds_to_universal names its output in `latest_universal`
        section = getattr(engine.config, "checkpoint", None)
        prefer = section.get("load_universal") if isinstance(section, dict) else getattr(section, "load_universal", 0)
        tag = universal_latest(load_dir, prefer=bool(prefer))
    tag = agree_on_tag(load_dir, tag)
    with contextlib.ExitStack() as keep:  # the files phase 2 reads stay until it is done
        try:
            if tag is not None:
                # A DeepSpeed checkpoint is converted (per rank, in a temporary directory) and read as ours.
                ds_dir = deepspeed_tag_dir(load_dir, tag)
                tmp_dir = keep.enter_context(converted(ds_dir, allow_pickle)) if ds_dir is not None else None
                tag_dir = tmp_dir or find_tag_dir(load_dir, tag)
                try:
                    loaded = read_for_engine(engine, tag_dir, options)
                except (KeyError, TypeError, IndexError) as exc:
                    raise CheckpointError(
                        f"{tag_dir / 'index.json'}: malformed ({exc!r}); the index is corrupt."
                    ) from exc
                keep.callback(loaded.reader.close)
                if ds_dir is not None:
                    loaded.tag_dir = ds_dir
        except Exception as exc:
            error = exc
        agree(error, f"load_checkpoint({load_dir}, tag={tag!r})")
        if loaded is None:
            logger.warning("load_checkpoint: no '%s/latest' file, nothing loaded.", load_dir)
            return None, None
        apply_to_engine(engine, loaded, options)
    if engine.global_rank == 0:
        logger.info("loaded checkpoint %s at step %d", loaded.tag_dir, engine.global_steps)
    return str(loaded.tag_dir), loaded.client_state


def agree_on_tag(load_dir: Path, tag: str | None) -> str | None:
    """The one tag every rank loads; collective.

    A rank that passes no tag loads the tag `latest` names as rank 0 read it (one read, so a
    `latest` rewritten meanwhile cannot make ranks load different checkpoints). Ranks that
    resolve to different tags (rank 0 tag="a", rank 1 tag="b") raise on every rank, naming
    them. None when no rank passed a tag and there is no `latest` file.

    Raises:
        CheckpointError: on every rank, when the ranks disagree or `latest` is unreadable.
    """
    latest: str | None = None
    latest_error: str | None = None
    if is_rank_zero():
        try:
            latest = read_latest(load_dir)
        except Exception as exc:  # shared with every rank below; raising here alone would hang them
            latest_error = str(exc) if isinstance(exc, CheckpointError) else f"{load_dir / 'latest'}: {describe(exc)}"
    passed = all_gather_object((tag, latest, latest_error))
    _, latest, latest_error = passed[0]
    if any(t is None for t, _, _ in passed) and latest_error is not None:
        raise CheckpointError(latest_error)
    resolved = [validate_tag(t) if t is not None else latest for t, _, _ in passed]
    if len(set(resolved)) > 1:
        by_rank = ", ".join(
            f"rank {r}: {t!r}" + (" (from latest)" if passed[r][0] is None else "") for r, t in enumerate(resolved)
        )
        raise CheckpointError(
            f"load_checkpoint({load_dir}): the ranks would load different checkpoints ({by_rank}); "
            "pass the same tag on every rank (or none, to load the one 'latest' names)."
        )
    return resolved[0]
