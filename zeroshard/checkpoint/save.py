"""Writing a checkpoint: every rank its own shards, rank 0 the index, then one atomic rename.

The sequence (see [Note: checkpoint layout] in format.py for what is written):

1. rank 0 makes `save_dir/.<tag>.tmp` (removing a leftover of a save that died);
2. every rank writes `rank_<r>.safetensors` there and fsyncs it;
3. rank 0 gathers what each rank wrote (fragments, sizes, checksums), writes the module
   extras, the index (last, so its presence means "every rank finished"), and renames the
   temporary directory to `save_dir/<tag>`; then it rewrites `latest`.

A process killed before step 3's rename leaves only a `.tmp` directory that nothing reads:
`latest` still names the previous complete tag.

This file takes the state from the engine (`rank_tensors`, `rank0_state`) and runs the
collective steps; write.py writes the files. An asynchronous save copies the state to host
memory here and hands the writing to a background thread ([Note: asynchronous saves] in
async_save.py).
"""

from __future__ import annotations

import io
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from zeroshard.autotp.split import tensor_split_of
from zeroshard.checkpoint import async_save as async_save_module
from zeroshard.checkpoint.files import remove_entry
from zeroshard.checkpoint.format import (
    FORMAT_NAME,
    FORMAT_VERSION,
    INDEX_DIGEST_FILE,
    MASTER_KIND,
    PYTHON_STATE_FILE,
    TENSOR_PARALLEL_VERSION,
    CheckpointError,
    dtype_to_str,
    scalar_kind,
    state_kind,
    tensor_name,
    tmp_tag_dir,
    validate_tag,
)
from zeroshard.checkpoint.frozen import frozen_state
from zeroshard.checkpoint.names import flat_names, saved_offset, saved_shape, state_dict_keys
from zeroshard.checkpoint.rng import capture_rng_state
from zeroshard.checkpoint.sync import agree, all_gather_object, describe
from zeroshard.checkpoint.write import (
    CRASH_ENV,  # noqa: F401 - the test hook's name, documented here
    UNFINISHED,
    Rank0State,
    crash_point,
    publish,
    write_rank0_files,
    write_rank_file,
)
from zeroshard.comm.simulated import refuse_in_simulation
from zeroshard.moe.autoep.export import hf_layouts
from zeroshard.sharding.ranges import overlap

logger = logging.getLogger("zeroshard")


def flat_id(index: int) -> str:
    return f"flat{index}"


# ----------------------------------------------------------------------- JSON helpers


def json_roundtrips(value: Any) -> bool:
    """Whether `value` comes back from JSON equal and of the same types (tuples do not)."""
    try:
        return json.loads(json.dumps(value)) == value and _same_types(json.loads(json.dumps(value)), value)
    except (TypeError, ValueError):
        return False


def _same_types(a: Any, b: Any) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return all(_same_types(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return all(_same_types(x, y) for x, y in zip(a, b, strict=True))
    return True


def param_groups_state(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Each param group's hyper-parameters (lr, betas, ...) as JSON, noting tuple values."""
    return [json_hyper({k: v for k, v in group.items() if k != "params"}) for group in optimizer.param_groups]


def json_hyper(hyper: dict[str, Any]) -> dict[str, Any]:
    """One group's hyper-parameters as the index stores them: 1-element tensors as numbers,
    tuples as lists (named in "tuple_keys" so a load restores them), values JSON cannot hold
    left out."""
    entry: dict[str, Any] = {}
    tuple_keys = []
    for key, value in hyper.items():
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if isinstance(value, tuple):
            tuple_keys.append(key)
            value = list(value)
        if json_roundtrips(value):
            entry[key] = value
    return {"hyper": entry, "tuple_keys": tuple_keys}


def _sampler_state(engine: Any) -> dict[str, Any] | None:
    loader = getattr(engine, "training_dataloader", None)
    sampler = getattr(loader, "sampler", None)
    if sampler is None:
        return None
    state: dict[str, Any] = {"class": type(sampler).__name__, "micro_steps": engine.micro_steps}
    for attr in ("epoch", "seed", "num_replicas", "shuffle", "drop_last"):
        value = getattr(sampler, attr, None)
        if isinstance(value, (bool, int, float)):
            state[attr] = value
    try:
        state["batches_per_epoch"] = len(loader)
    except TypeError:
        pass
    return state


# -------------------------------------------------------------------- the rank's file


def _host_view(tensor: torch.Tensor) -> torch.Tensor:
    """A synchronous save writes before training resumes: no copy here. The rank file's writer
    brings each tensor to the host as it writes it (write.py), so the host holds one at a time."""
    return tensor.contiguous()


def rank_tensors(
    engine: Any, rank: int, to_host: Callable[[torch.Tensor], torch.Tensor] = _host_view
) -> tuple[dict[str, torch.Tensor], dict[str, str], list[dict[str, Any]]]:
    """(tensors, metadata, flats info) of this rank's file: its owned slice of every flat buffer.

    `to_host` moves each slice to the host; an asynchronous save passes one that copies, so the
    training step that follows cannot change what is written.
    """
    tensors: dict[str, torch.Tensor] = {}
    opt_state = engine.optimizer.state if engine.optimizer is not None else {}
    flats_info = []
    saved_names = flat_names(engine)
    for k, flat in enumerate(engine.flats):
        fid = flat_id(k)
        owned_start, owned_len = flat.shard_start, flat.shard_numel
        master_start, _ = flat.master_range()
        position = owned_start - master_start  # 0 at stages 1-3; the shard's start at stage 0

        def owned(tensor: torch.Tensor, position: int = position, owned_len: int = owned_len) -> torch.Tensor:
            return to_host(tensor.detach().reshape(-1).narrow(0, position, owned_len))

        tensors[tensor_name(MASTER_KIND, fid)] = owned(flat.master)
        elementwise: dict[str, str] = {}
        scalars: dict[str, str] = {}
        for key, value in opt_state.get(flat.master, {}).items():
            if value is None:  # e.g. SGD without momentum keeps momentum_buffer=None
                continue
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.numel() == flat.master.numel():
                tensors[tensor_name(state_kind(key), fid)] = owned(value)
                elementwise[key] = dtype_to_str(value.dtype)
            elif isinstance(value, torch.Tensor) and value.numel() == 1:
                # Saved in its own shape: a custom optimizer's [1] state must not come back 0-d.
                tensors[tensor_name(scalar_kind(key), fid)] = value.detach().cpu().clone()
                scalars[key] = "tensor"
            elif isinstance(value, (bool, int, float)):
                dtype = torch.float64 if isinstance(value, float) else torch.int64
                tensors[tensor_name(scalar_kind(key), fid)] = torch.tensor(value, dtype=dtype)
                scalars[key] = type(value).__name__
            else:
                raise ValueError(
                    f"save_checkpoint: optimizer state {key!r} of {type(engine.optimizer).__name__} is "
                    f"neither elementwise (shaped like the master weights) nor a scalar "
                    f"({type(value).__name__}); zeroshard cannot shard it."
                )
        fragments = {}
        # One replica of each shard is indexed (hybrid sharding: the first replica group's; a
        # parameter tensor parallelism keeps whole: tensor rank 0's); offsets are in the shard
        # group's layout, `rank` names the file that holds them. A tensor-parallel piece is
        # indexed by every tensor rank, its offsets inside its piece (`tp_index` says which).
        duplicate = flat.spec.duplicate
        indexed = flat.spec.replicate.rank == 0 and (duplicate is None or duplicate.rank == 0)
        for i, name in enumerate(saved_names[k]):
            common = overlap(flat.offsets[i], flat.offsets[i] + flat.numels[i], owned_start, owned_start + owned_len)
            if indexed and common is not None:
                lo, hi = common
                fragments[name] = {
                    "rank": rank,
                    "offset": lo - flat.offsets[i] + saved_offset(flat.params[i]),
                    "numel": hi - lo,
                    "tensor": fid,
                    "start": lo - owned_start,
                }
                split = tensor_split_of(flat.params[i])
                if split is not None:
                    fragments[name]["tp_index"] = split.index
        info = {"id": fid, "fragments": fragments, "optimizer_state": elementwise, "optimizer_scalars": scalars}
        if saved_names[k] != flat.names:
            # Expert parameters: rank 0 does not hold every expert, so each rank describes its own.
            info["params"] = _param_entries(flat, saved_names[k], elementwise, scalars)
        flats_info.append(info)

    rng_tensors, rng_metadata = capture_rng_state()
    tensors.update(rng_tensors)
    metadata = {"rank": str(rank), "world_size": str(engine.world_size), **rng_metadata}
    return tensors, metadata, flats_info


# ------------------------------------------------------------------------- rank 0 only


def module_names(engine: Any) -> tuple[dict[str, str], list[str], list[str]]:
    """(aliases: tied name -> managed name, frozen parameter names, persistent buffer names).

    Names are the module's own, in `state_dict` order.
    """
    module = engine.module
    managed = {id(p): name for flat in engine.flats for name, p in zip(flat.names, flat.params, strict=True)}
    params = dict(module.named_parameters(remove_duplicate=False))
    buffers = dict(module.named_buffers(remove_duplicate=False))
    aliases, frozen, buffer_names = {}, [], []
    for key in module.state_dict(keep_vars=True):
        if key in params:
            owner = managed.get(id(params[key]))
            if owner is None:
                frozen.append(key)
            elif owner != key:
                aliases[key] = owner
        elif key in buffers:
            buffer_names.append(key)
    return aliases, frozen, buffer_names


def _extras(engine: Any, frozen: dict[str, torch.Tensor], buffer_names: list[str]) -> tuple[dict, dict]:
    """(tensors, index entries) of the module extras: frozen parameters (`frozen`: by checkpoint
    name, whole, from `frozen_state`) and persistent buffers, copied as the module holds them."""
    buffers = dict(engine.module.named_buffers(remove_duplicate=False))
    tensors = dict(frozen)
    tensors.update({name: buffers[name].detach().to("cpu", copy=True) for name in buffer_names})

    def describe_tensors(names: list[str]) -> dict[str, Any]:
        return {n: {"shape": list(tensors[n].shape), "dtype": dtype_to_str(tensors[n].dtype)} for n in names}

    return tensors, {"frozen_params": describe_tensors(frozen), "buffers": describe_tensors(buffer_names)}


def _param_entries(flat: Any, names: list[str], elementwise: dict, scalars: dict) -> dict[str, Any]:
    entries = {
        name: {
            "shape": list(saved_shape(flat.params[i])),
            "param_dtype": dtype_to_str(flat.role.param_dtype),
            "master_dtype": dtype_to_str(flat.master.dtype),
            "unit": flat.unit_name,
            "role": flat.role.name,
            "optimizer_group": flat.optimizer_group,
            "optimizer_state": elementwise,
            "optimizer_scalars": scalars,
            "fragments": [],
        }
        for i, name in enumerate(names)
    }
    for i, name in enumerate(names):
        split = tensor_split_of(flat.params[i])
        if split is not None:  # saved as its pieces: checkpoint/format.py's [Note: checkpoint layout]
            entries[name]["tensor_parallel"] = split.to_json()
    return entries


def _params_table(engine: Any, manifests: list[dict[str, Any]]) -> dict[str, Any]:
    params: dict[str, Any] = {}
    for k, (flat, names) in enumerate(zip(engine.flats, flat_names(engine), strict=True)):
        info = manifests[0]["flats"][k]
        params.update(_param_entries(flat, names, info["optimizer_state"], info["optimizer_scalars"]))
    for manifest in manifests:
        for info in manifest["flats"]:
            for name, entry in info.get("params", {}).items():
                params.setdefault(name, entry)
    for manifest in manifests:
        for info in manifest["flats"]:
            for name, fragment in info["fragments"].items():
                params[name]["fragments"].append(fragment)
    return params


def _flats_table(engine: Any) -> list[dict[str, Any]]:
    return [
        {
            "id": flat_id(k),
            "unit": flat.unit_name,
            "role": flat.role.name,
            "optimizer_group": flat.optimizer_group,
            "names": list(flat.names),
            "numel": flat.numel,
            "padded_numel": flat.padded_numel,
            "shard_numel": flat.shard_numel,
        }
        for k, flat in enumerate(engine.flats)
    ]


def rank0_state(
    engine: Any, tag: str, manifests: list[dict[str, Any]], client_state: Any, frozen: dict[str, torch.Tensor]
) -> Rank0State:
    """Rank 0's part of a save, from the engine; `manifests` are every rank's flats info."""
    aliases, _, buffer_names = module_names(engine)
    extras, extras_entries = _extras(engine, frozen, buffer_names)

    # Plain JSON where possible (readable, no pickle); torch.save for the rest.
    python_state: dict[str, Any] = {}
    scheduler = engine.lr_scheduler
    scheduler_state = scheduler.state_dict() if scheduler is not None and hasattr(scheduler, "state_dict") else None
    scheduler_entry: dict[str, Any] | None = None
    if scheduler_state is not None:
        if json_roundtrips(scheduler_state):
            scheduler_entry = {"json": scheduler_state}
        else:
            python_state["lr_scheduler"] = scheduler_state
            scheduler_entry = {"file": PYTHON_STATE_FILE}
    client_state = {} if client_state is None else client_state
    if json_roundtrips(client_state):
        client_entry: dict[str, Any] = {"json": client_state}
    else:
        python_state["client_state"] = client_state
        client_entry = {"file": PYTHON_STATE_FILE}
    pickled = None
    if python_state:
        buffer = io.BytesIO()
        torch.save(python_state, buffer)
        pickled = buffer.getvalue()

    optimizer = engine.optimizer
    index = {
        "format": FORMAT_NAME,
        # Tensor-parallel pieces: a reader that does not know them must not load them as whole tensors.
        "version": TENSOR_PARALLEL_VERSION if engine.layout.tensor is not None else FORMAT_VERSION,
        "tag": tag,
        "world_size": engine.world_size,
        "stage": engine.policy.stage,
        "precision_mode": engine.precision_plan.mode,
        "torch_version": torch.__version__,
        "files": None,  # filled in by write_rank0_files, in this place
        "params": _params_table(engine, manifests),
        "aliases": aliases,
        **extras_entries,
        "state_dict_keys": state_dict_keys(engine.module),
        "autoep": hf_layouts(engine.module),  # to-fp32 writes these layers under Hugging Face names
        "flats": _flats_table(engine),
        "counters": {
            "global_steps": engine.global_steps,
            "micro_steps": engine.micro_steps,
            # micro_steps' unit: a load at another accumulation restores the position in windows.
            "gradient_accumulation_steps": engine.config.gradient_accumulation_steps,
            "skipped_steps": engine.skipped_steps,
            "global_samples": engine.global_samples,
        },
        "optimizer": None
        if optimizer is None
        else {
            "class": getattr(optimizer, "checkpoint_class", type(optimizer).__name__),  # load.optimizer_class
            "param_groups": param_groups_state(optimizer),
        },
        "loss_scaler": engine.loss_scaler.state_dict(),
        "lr_scheduler": scheduler_entry,
        "data_sampler": _sampler_state(engine),
        "client_state": client_entry,
        "index_digest": INDEX_DIGEST_FILE,
        "config": engine.config.raw,
        "precision_plan": engine.precision_plan.as_dict(),
    }
    return Rank0State(index, extras, pickled)


def _prepare_tmp_dir(save_dir: Path, tag: str, tmp: Path) -> None:
    """Rank 0, before anything is written: refuse a linked tag, clean up, create `tmp`."""
    final = save_dir / tag
    if final.is_symlink():
        raise CheckpointError(
            f"{final}: a symbolic link; a save replaces the tag directory by renaming, which would "
            "replace the link and leave its target stale. Remove the link or save under another tag."
        )
    save_dir.mkdir(parents=True, exist_ok=True)
    for stale in sorted(UNFINISHED):
        remove_entry(stale)
        UNFINISHED.discard(stale)
    remove_entry(tmp)  # a save of this tag that died part-way (perhaps in another process)
    UNFINISHED.add(tmp.absolute())
    tmp.mkdir()


# ------------------------------------------------------------------------------ entry

TAG_VALIDATION_MODES = ("IGNORE", "WARN", "FAIL")


def tag_validation_mode(engine: Any) -> str:
    """`checkpoint.tag_validation` of the engine's config, upper-cased (DeepSpeed's default "Warn").

    Read from either form of the config's `checkpoint` section (a plain table, or a model
    with a `tag_validation` attribute).
    """
    section = getattr(engine.config, "checkpoint", None)
    value = section.get("tag_validation") if isinstance(section, dict) else getattr(section, "tag_validation", None)
    value = getattr(value, "value", value)  # an enum member
    mode = "WARN" if value is None else str(value).upper()
    if mode not in TAG_VALIDATION_MODES:
        raise CheckpointError(
            f"checkpoint.tag_validation={value!r}: must be one of Ignore, Warn, Fail. "
            'Set e.g. "checkpoint": {"tag_validation": "Warn"}.'
        )
    return mode


def agree_on_save_tag(engine: Any, tag: str | None) -> str:
    """The tag every rank saves under; collective.

    None or "" mean DeepSpeed's default, `global_step<N>`. If the ranks passed different
    tags, `checkpoint.tag_validation` decides: "Fail" raises on every rank; "Warn" (the
    default) logs the tags and "Ignore" says nothing, and both save under rank 0's tag (a
    checkpoint is one directory that every rank writes into).
    """
    if tag is None or tag == "":
        tag = f"global_step{engine.global_steps}"
    tags = all_gather_object(str(tag))
    mode = tag_validation_mode(engine)
    if len(set(tags)) > 1:
        by_rank = ", ".join(f"rank {r}: {t!r}" for r, t in enumerate(tags))
        message = f"save_checkpoint: the ranks passed different tags ({by_rank})"
        if mode == "FAIL":
            raise CheckpointError(
                f"{message}; checkpoint.tag_validation is Fail. Pass the same tag on every rank "
                "(one without rank-specific parts)."
            )
        if mode == "WARN" and engine.global_rank == 0:
            logger.warning("%s; saving under rank 0's tag %r (checkpoint.tag_validation is Warn).", message, tags[0])
    return tags[0]



def _agree_prepared(error: BaseException | None, asynchronous: bool, what: str) -> None:
    """`agree` on creating the temporary directory, and on the save's mode in the same collective:
    ranks that disagree on it would go on into different collectives."""
    outcomes = all_gather_object((None if error is None else describe(error), asynchronous))
    agree_outcomes = [message for message, _ in outcomes]
    failed = {rank: message for rank, message in enumerate(agree_outcomes) if message is not None}
    if failed:
        if error is not None:
            raise error
        details = "; ".join(f"rank {rank}: {message}" for rank, message in sorted(failed.items()))
        raise CheckpointError(f"{what} failed on rank(s) {sorted(failed)}: {details}")
    modes = [mode for _, mode in outcomes]
    if len(set(modes)) > 1:
        raise CheckpointError(
            f"save_checkpoint: asynchronous on rank(s) {[r for r, m in enumerate(modes) if m]} and "
            f"synchronous on the others; pass the same async_save on every rank."
        )


def save_checkpoint(
    engine: Any,
    save_dir: str | os.PathLike,
    tag: str | None = None,
    client_state: Any = None,
    save_latest: bool = True,
    *,
    async_save: bool | None = None,
) -> str:
    """Save `engine`'s training state under `save_dir/tag`; collective (every rank calls it).

    Waits for this process's previous asynchronous save first (raising its error on every rank
    if it failed). `async_save` (None: `checkpoint.writer.decoupled` of the config) returns as
    soon as the state is copied to host memory and writes the files in the background
    (zeroshard/checkpoint/async_save.py).

    Returns:
        The checkpoint's directory.
    """
    refuse_in_simulation("save_checkpoint")
    if save_dir is None or os.fspath(save_dir) == "":
        # Path("") is the working directory: DeepSpeed 0.19 refuses it rather than write there.
        raise CheckpointError(
            f"save_checkpoint: save_dir={save_dir!r}: must be a non-empty path. Pass the directory to "
            "write the checkpoint into (it is created if missing)."
        )
    save_dir = Path(save_dir)
    async_save_module.wait_for_checkpoint(f"save_checkpoint({save_dir}, tag={tag!r})")
    asynchronous = async_save_module.decoupled(engine) if async_save is None else bool(async_save)
    rank = engine.global_rank
    tag = agree_on_save_tag(engine, tag)
    validate_tag(tag)  # after the agreement, so that every rank raises or none does
    tmp = tmp_tag_dir(save_dir, tag)

    error: BaseException | None = None
    if rank == 0:
        try:
            _prepare_tmp_dir(save_dir, tag, tmp)
        except (OSError, CheckpointError) as exc:
            error = exc
    _agree_prepared(error, asynchronous, f"save_checkpoint({save_dir}, tag={tag!r}): creating {tmp}")
    if asynchronous:
        _start_async(engine, save_dir, tag, tmp, client_state, save_latest)
        return str(save_dir / tag)

    manifest, error = None, None
    try:
        tensors, metadata, flats = rank_tensors(engine, rank)
        manifest = {"rank": rank, **write_rank_file(tmp, rank, tensors, metadata), "flats": flats}
    except Exception as exc:
        error = exc
    crash_point("rank_file", rank)
    gathered = all_gather_object(manifest if error is None else describe(error))
    if error is not None:
        raise error
    failed = {r: m for r, m in enumerate(gathered) if isinstance(m, str)}
    if failed:
        raise CheckpointError(f"save_checkpoint: writing the shards failed on rank(s) {sorted(failed)}: {failed}")

    # Every rank: expert-parallel ranks hold different frozen experts (checkpoint/frozen.py).
    frozen = frozen_state(engine, module_names(engine)[1], keep=rank == 0)
    error = None
    if rank == 0:
        try:
            write_rank0_files(tmp, rank0_state(engine, tag, gathered, client_state, frozen), gathered)
            crash_point("before_rename", rank)
            publish(save_dir, tag, tmp, save_latest)
            UNFINISHED.discard(tmp.absolute())
        except Exception as exc:
            error = exc
    agree(error, f"save_checkpoint({save_dir}, tag={tag!r}): writing the index")
    if rank == 0:
        logger.info(
            "saved checkpoint %s (world size %d, stage %d)", save_dir / tag, engine.world_size, engine.policy.stage
        )
    return str(save_dir / tag)


def _start_async(
    engine: Any, save_dir: Path, tag: str, tmp: Path, client_state: Any, save_latest: bool
) -> None:
    """Copy this rank's state to host memory, agree that every rank did, and hand it to a
    background writer (async_save.py). Collective; no file is written here."""
    rank = engine.global_rank
    snapshot, error = None, None
    copy = async_save_module.host_copy()
    try:
        tensors, metadata, flats = rank_tensors(engine, rank, copy)
        snapshot = (tensors, metadata)
    except Exception as exc:
        error = exc
    gathered = all_gather_object({"rank": rank, "flats": flats} if error is None else describe(error))
    if error is not None:
        raise error
    failed = {r: m for r, m in enumerate(gathered) if isinstance(m, str)}
    if failed:
        raise CheckpointError(f"save_checkpoint: copying the shards failed on rank(s) {sorted(failed)}: {failed}")

    frozen = frozen_state(engine, module_names(engine)[1], keep=rank == 0)
    state, error = None, None
    if rank == 0:
        try:
            state = rank0_state(engine, tag, gathered, client_state, frozen)
            # Taken now: client_state and the scheduler's state may change while the files are written.
            state.index = json.loads(json.dumps(state.index, default=str))
        except Exception as exc:
            error = exc
    agree(error, f"save_checkpoint({save_dir}, tag={tag!r}): collecting the index")
    tensors, metadata = snapshot
    async_save_module.start(
        async_save_module.WriteJob(
            save_dir=save_dir, tag=tag, tmp=tmp, rank=rank, world_size=len(gathered),
            tensors=tensors, metadata=metadata, rank0=state, save_latest=save_latest,
            timeout_s=engine.config.zeroshard.collective_timeout_s,
        ),
        copy,
    )
