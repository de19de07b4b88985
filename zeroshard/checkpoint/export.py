"""Consolidated, unsharded exports: the fp32 state dict of a checkpoint, and 16-bit weights.

Both give a state dict with the model's own names, in `model.state_dict()` order, tied
parameters under every name they have (as separate tensors: safetensors refuses shared
storage), persistent buffers included, so `model.load_state_dict(sd, strict=True)` works
on a plain, unwrapped model.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from zeroshard.checkpoint.async_save import join_writer
from zeroshard.checkpoint.deepspeed.convert import deepspeed_tag_dir
from zeroshard.checkpoint.deepspeed.fp32 import deepspeed_fp32_state_dict
from zeroshard.checkpoint.export_16bit import gathered_parameters, stream_16bit, streamable
from zeroshard.checkpoint.files import write_via_private_dir
from zeroshard.checkpoint.format import CheckpointReader, resolve_checkpoint_dir, str_to_dtype
from zeroshard.checkpoint.frozen import frozen_state, moe_expert_places, whole_by_saved_name
from zeroshard.checkpoint.names import state_dict_keys
from zeroshard.checkpoint.save import module_names
from zeroshard.checkpoint.stream import StreamedSafetensors
from zeroshard.checkpoint.sync import agree
from zeroshard.comm.simulated import refuse_in_simulation
from zeroshard.moe.autoep.export import hf_layouts, to_hf_state_dict


def consolidate_fp32(ckpt_dir: str | os.PathLike, tag: str | None = None) -> dict[str, torch.Tensor]:
    """The full fp32 state dict of a sharded checkpoint (no process group needed).

    Args:
        ckpt_dir: a save directory (its `latest` tag is used unless `tag` is given) or one
            checkpoint's tag directory.
        tag: which checkpoint of `ckpt_dir`.

    Returns:
        Parameter and buffer name -> tensor: the master weights in fp32 for trained
        parameters, floating buffers and frozen parameters cast to fp32, others as saved.

    Raises:
        CheckpointError: no such checkpoint, or a missing or corrupt file (named).
    """
    join_writer()  # this process's asynchronous save, if one is being written, is read complete
    tag_dir = resolve_checkpoint_dir(ckpt_dir, tag)
    with CheckpointReader(tag_dir) as reader:
        index = reader.index
        extras = reader.extras()
        managed = {name: reader.read_full(name).to(torch.float32) for name in index["params"]}
    aliases = index.get("aliases", {})
    out: dict[str, torch.Tensor] = {}
    for key in index["state_dict_keys"]:
        if key in managed:
            value = managed[key]
        elif key in aliases:
            value = managed[aliases[key]].clone()
        else:
            value = extras[key]
            if value.is_floating_point():
                value = value.to(torch.float32)
        out[key] = value
    return to_hf_state_dict(out, index.get("autoep") or {})


def _write_state_dict(state: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None) -> None:
    """safetensors for a .safetensors name, torch.save otherwise; atomic, never through a link."""
    if path.suffix == ".safetensors":
        tensors = {k: v.contiguous() for k, v in state.items()}
        write_via_private_dir(path, lambda tmp: save_file(tensors, str(tmp), metadata=metadata))
    else:
        write_via_private_dir(path, lambda tmp: torch.save(state, tmp))


def write_fp32(
    ckpt_dir: str | os.PathLike, out_path: str | os.PathLike, tag: str | None = None,
    exclude: frozenset[str] = frozenset(),
) -> Path:
    """`consolidate_fp32` written to `out_path` (safetensors, or torch.save for other suffixes);
    a DeepSpeed checkpoint directory is read as DeepSpeed's zero_to_fp32 reads it. `exclude`:
    state dict keys left out.

    A zeroshard checkpoint written to a .safetensors file is streamed: one parameter is built
    from its fragments, written and dropped before the next, so the host holds the largest
    parameter (in fp32, with its fragments), never the model ([Note: streamed safetensors]).
    """
    join_writer()
    out_path = Path(out_path)
    tag_dir = deepspeed_tag_dir(ckpt_dir, tag)
    if tag_dir is not None:
        state = deepspeed_fp32_state_dict(tag_dir)
    else:
        tag_dir = resolve_checkpoint_dir(ckpt_dir, tag)  # once: `latest` may change meanwhile
        if out_path.suffix == ".safetensors":
            with CheckpointReader(tag_dir) as reader:
                if not reader.index.get("autoep"):  # AutoEP stacks are re-laid out whole (to_hf_state_dict)
                    metadata = {"format": "pt", "source": str(tag_dir)}
                    write_via_private_dir(out_path, lambda tmp: _stream_fp32(reader, tmp, metadata, exclude))
                    return out_path
        state = consolidate_fp32(tag_dir)
    state = {k: v for k, v in state.items() if k not in exclude}
    _write_state_dict(state, out_path, {"format": "pt", "source": str(tag_dir)})
    return out_path


def _fp32_entries(index: dict[str, Any]) -> dict[str, tuple[str, str, torch.dtype, tuple[int, ...]]]:
    """key -> (where it comes from: "param" / "extra", the name there, dtype, shape) of the
    consolidated fp32 state dict, in `model.state_dict()` order."""
    aliases = index.get("aliases", {})
    extras = {**index.get("buffers", {}), **index.get("frozen_params", {})}
    out = {}
    for key in index["state_dict_keys"]:
        name = aliases.get(key, key)
        if name in index["params"]:
            out[key] = ("param", name, torch.float32, tuple(index["params"][name]["shape"]))
        else:
            dtype = str_to_dtype(extras[key]["dtype"])
            out[key] = ("extra", key, torch.float32 if dtype.is_floating_point else dtype, tuple(extras[key]["shape"]))
    return out


def _stream_fp32(reader: CheckpointReader, path: Path, metadata: dict[str, str], exclude: frozenset[str]) -> None:
    entries = {k: v for k, v in _fp32_entries(reader.index).items() if k not in exclude}
    with StreamedSafetensors(path, [(k, dtype, shape) for k, (_, _, dtype, shape) in entries.items()],
                             metadata) as out:
        for key, (source, name, dtype, _) in entries.items():
            value = reader.read_full(name) if source == "param" else reader.extra(name)
            out.write(key, value.to(dtype))
            del value


def consolidated_16bit_state_dict(
    engine: Any, exclude_frozen_parameters: bool = False
) -> dict[str, torch.Tensor] | None:
    """The module's full state dict in the parameter dtype, on the host: a dict on rank 0,
    None on the other ranks. Collective.

    At stage 3 each unit is gathered in turn (and freed again), so no rank ever holds more
    than one unit's full parameters beyond what training already holds.
    `exclude_frozen_parameters` leaves out parameters with `requires_grad=False` (DeepSpeed's
    option, for adapters trained on a frozen base).
    """
    rank0 = engine.global_rank == 0
    # Experts (of MoE layers and AutoEP stacks) differ across expert-parallel ranks: each is
    # gathered over its group and written by its global name (checkpoint/frozen.py).
    places = moe_expert_places(engine.module)
    managed: dict[str, torch.Tensor] = {}
    for name, p in gathered_parameters(engine):
        managed.update(whole_by_saved_name(engine, name, p, places, keep=rank0))

    aliases, frozen_names, _ = module_names(engine)
    frozen = frozen_state(engine, frozen_names, keep=rank0)
    state: dict[str, torch.Tensor] | None = None
    error: BaseException | None = None
    if rank0:
        try:
            state = _assemble(engine, managed, aliases, frozen, exclude_frozen_parameters)
        except Exception as exc:
            error = exc
    agree(error, "consolidated_16bit_state_dict")
    return state


def _assemble(
    engine: Any, managed: dict[str, torch.Tensor], aliases: dict[str, str], frozen: dict[str, torch.Tensor],
    exclude_frozen_parameters: bool,
) -> dict[str, torch.Tensor]:
    """Rank 0's state dict in `model.state_dict()` order from the gathered pieces."""
    tensors = dict(engine.module.named_parameters(remove_duplicate=False))
    excluded = {k for k, p in tensors.items() if exclude_frozen_parameters and not p.requires_grad}
    tensors.update(engine.module.named_buffers(remove_duplicate=False))
    state = {}
    for key in state_dict_keys(engine.module):  # experts by global name
        if key in excluded:
            continue
        if key in managed:
            state[key] = managed[key]
        elif key in aliases:
            state[key] = managed[aliases[key]].clone()
        elif key in frozen:
            state[key] = frozen[key]
        else:
            state[key] = tensors[key].detach().to("cpu", copy=True)
    return to_hf_state_dict(state, hf_layouts(engine.module))


def save_16bit_model(
    engine: Any,
    save_dir: str | os.PathLike,
    save_filename: str = "pytorch_model.safetensors",
    exclude_frozen_parameters: bool = False,
) -> str:
    """`consolidated_16bit_state_dict` written by rank 0 to save_dir/save_filename. Collective.

    A .safetensors file is streamed (dense models): each unit is gathered in turn and rank 0
    writes its parameters before the next, so rank 0's host holds one unit at a time, not the
    model (export_16bit.py).

    Returns:
        The written file's path (on every rank).
    """
    refuse_in_simulation("save_16bit_model")
    path = Path(save_dir) / save_filename
    if path.suffix == ".safetensors" and streamable(engine):
        stream_16bit(engine, path, exclude_frozen_parameters)
        return str(path)
    state = consolidated_16bit_state_dict(engine, exclude_frozen_parameters)
    error: BaseException | None = None
    if state is not None:
        try:
            _write_state_dict(state, path, {"format": "pt"})
        except Exception as exc:
            error = exc
    agree(error, f"save_16bit_model({path})")
    return str(path)
