"""`save_16bit_model` streamed: each unit gathered in turn, written by rank 0, freed.

The consolidated 16-bit file holds the whole model, but no host needs to: rank 0 opens a streamed
safetensors file ([Note: streamed safetensors] in stream.py) with every tensor's name, dtype and
shape, and the units are gathered one after another (a collective, as in
`consolidated_16bit_state_dict`); rank 0 writes each unit's parameters (copied to the host one
tensor at a time) before the next unit is gathered, then the frozen parameters and buffers one by
one. A write error on rank 0 does not stop it gathering (the other ranks are in the same
collectives); every rank raises it at the end. Models with MoE experts or AutoEP stacks (which
are gathered over their own groups and renamed) take the whole-dict path of export.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from zeroshard.checkpoint.files import write_via_private_dir
from zeroshard.checkpoint.frozen import moe_expert_places
from zeroshard.checkpoint.names import state_dict_keys
from zeroshard.checkpoint.save import module_names
from zeroshard.checkpoint.stream import StreamedSafetensors
from zeroshard.checkpoint.sync import agree
from zeroshard.moe.autoep.export import hf_layouts

__all__ = ["stream_16bit", "streamable"]


def streamable(engine: Any) -> bool:
    """Dense models: no expert gathered over an expert group, no AutoEP stack to re-lay out."""
    return not moe_expert_places(engine.module) and not hf_layouts(engine.module)


def _entries(engine: Any, exclude_frozen: bool) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    module = engine.module
    params = dict(module.named_parameters(remove_duplicate=False))
    buffers = dict(module.named_buffers(remove_duplicate=False))
    out = []
    for key in state_dict_keys(module):
        if key in params:
            p = params[key]
            if exclude_frozen and not p.requires_grad:
                continue
            shape = getattr(p, "ds_shape", None) if p.numel() == 0 else None
            out.append((key, p.dtype, tuple(p.shape if shape is None else shape)))
        elif key in buffers:
            out.append((key, buffers[key].dtype, tuple(buffers[key].shape)))
    return out


class _Rank0Writer:
    """Rank 0's side: writes what the gathers bring, remembers the first error, goes on."""

    def __init__(self, out: StreamedSafetensors | None, aliases_of: dict[str, list[str]]) -> None:
        self.out = out
        self.aliases_of = aliases_of
        self.error: BaseException | None = None

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if self.out is None or self.error is not None:
            return
        try:
            for key in (name, *self.aliases_of.get(name, ())):
                if key in self.out.names:
                    self.out.write(key, tensor)
        except Exception as exc:  # noqa: BLE001 - raised on every rank after the gathers
            self.error = exc


def gathered_parameters(engine: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """Every managed parameter by name, whole: each unit gathered in turn (bit-exact, not in the
    wire dtype) and freed again after its parameters are used, so no rank holds more than one
    unit's full parameters beyond what training holds. Collective: every rank iterates it all."""
    for unit in engine.units:
        was_gathered = unit.gathered
        if not was_gathered:
            unit.gather(tag="export", exact=True)
        try:
            for flat in unit.flats:
                yield from zip(flat.names, flat.params, strict=True)
        finally:
            if not was_gathered:
                unit.free()


def _gather_and_write(engine: Any, writer: _Rank0Writer, frozen: list[str]) -> None:
    for name, p in gathered_parameters(engine):
        writer.write(name, p.detach())
    module = engine.module
    params = dict(module.named_parameters(remove_duplicate=False))
    for name in frozen:  # whole on every rank already
        writer.write(name, params[name].detach())
    for name, buf in module.named_buffers(remove_duplicate=False):
        writer.write(name, buf.detach())


def stream_16bit(engine: Any, path: Path, exclude_frozen_parameters: bool) -> None:
    """Write the consolidated 16-bit state dict to `path` (.safetensors), streamed; collective."""
    rank0 = engine.global_rank == 0
    aliases, frozen, _ = module_names(engine)
    aliases_of: dict[str, list[str]] = {}
    for alias, target in aliases.items():
        aliases_of.setdefault(target, []).append(alias)
    error: BaseException | None = None
    if rank0:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            error = exc
    agree(error, f"save_16bit_model({path})")
    if not rank0:
        _gather_and_write(engine, _Rank0Writer(None, aliases_of), frozen)
        agree(None, f"save_16bit_model({path})")
        return
    writer = _Rank0Writer(None, aliases_of)
    ran = False

    def write(tmp: Path) -> None:
        nonlocal ran
        out = None
        try:
            out = StreamedSafetensors(tmp, _entries(engine, exclude_frozen_parameters), {"format": "pt"})
        except Exception as exc:  # noqa: BLE001 - rank 0 must still join every gather
            writer.error = exc
        writer.out = out
        ran = True
        try:
            _gather_and_write(engine, writer, frozen)
        finally:
            if out is not None:
                out.close() if writer.error is None else out.abort()
        if writer.error is not None:
            raise writer.error

    try:
        write_via_private_dir(path, write)
    except Exception as exc:  # noqa: BLE001 - agreed below, raised on every rank
        error = exc
    if not ran:  # the private directory could not be made: still join the other ranks' gathers
        _gather_and_write(engine, _Rank0Writer(None, aliases_of), frozen)
    agree(error, f"save_16bit_model({path})")
