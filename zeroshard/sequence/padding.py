"""Sequences whose length is not a multiple of the sequence-parallel size P.

Ulysses gives every rank of the sequence group an equal slice, so a sequence of N positions is
padded at its end to the next multiple of P. The padding must then stay invisible:

- `shard_sequence(x, group, dim)` pads the whole sequence and returns this rank's equal slice
  (a replicated [CLS] token, `has_cls_token=True`, stays in front of every slice);
- inside `with padded_sequence(valid_length=N):` the AutoSP wrappers know which positions are
  padding. `UlyssesSPViTAttention` drops the padded patches before its gathered attention
  (exactly a key mask for the real patches, and it also holds for opaque attention modules and
  for Qwen2-VL's `cu_seqlens`, which count real patches only) and returns zeros there; the
  fusion adapters put no visual feature on a padded position;
- `valid_positions(local_length, group)` is this rank's mask of real positions, to keep the
  padding out of the loss (e.g. with `zeroshard.sequence.loss.token_weighted_loss`);
- `unshard_sequence(x, group, valid_length, dim)` gathers the slices (differentiably) and
  strips the padding, giving the single-device layout back.

Causal text attention (ALST) needs no mask: padding sits after every real token, so no real
query attends to it, and `UlyssesSPDataLoaderAdapter` labels it -100.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any

import torch
from torch import Tensor

from zeroshard.comm import collectives as comm
from zeroshard.sequence.gather import gather_sequence

__all__ = [
    "current_valid_length",
    "padded_length",
    "padded_sequence",
    "real_positions",
    "shard_sequence",
    "unshard_sequence",
    "valid_positions",
]

_VALID_LENGTH: ContextVar[int | None] = ContextVar("zeroshard_sequence_valid_length", default=None)


def padded_length(length: int, world: int) -> int:
    """`length` rounded up to a multiple of `world`."""
    return -(-length // world) * world


@contextlib.contextmanager
def padded_sequence(valid_length: int) -> Iterator[None]:
    """Within the block, sharded sequences hold `valid_length` real positions (the rest, at the
    end of the whole sequence, is padding); the AutoSP wrappers keep it out of attention."""
    if valid_length < 0:
        raise ValueError(f"valid_length={valid_length}: must be >= 0. Pass the unpadded sequence length.")
    token = _VALID_LENGTH.set(int(valid_length))
    try:
        yield
    finally:
        _VALID_LENGTH.reset(token)


def current_valid_length() -> int | None:
    """The `valid_length` of the innermost `padded_sequence` block (None outside one)."""
    return _VALID_LENGTH.get()


def real_positions(local_length: int, valid_length: int | None, group: comm.Group) -> int:
    """How many of this rank's `local_length` positions are real when every rank holds an equal
    slice of a sequence with `valid_length` real positions (None: all of them)."""
    if valid_length is None:
        return local_length
    if valid_length > local_length * group.size:
        raise ValueError(
            f"valid_length={valid_length}: more than the {local_length * group.size} positions the "
            f"{group.size} slices of {local_length} hold. Shard with shard_sequence (equal slices)."
        )
    return max(0, min(local_length, valid_length - group.rank * local_length))


def valid_positions(local_length: int, group: Any, valid_length: int | None = None, device: Any = None) -> Tensor:
    """[local_length] bool: which of this rank's positions are real (`valid_length` defaults to
    the enclosing `padded_sequence` block's)."""
    if valid_length is None:
        valid_length = current_valid_length()
    real = real_positions(local_length, valid_length, comm.as_group(group))
    return torch.arange(local_length, device=device) < real


def shard_sequence(x: Tensor, group: Any, dim: int = 1, has_cls_token: bool = False, value: float = 0) -> Tensor:
    """This rank's equal slice of the whole sequence `x` along `dim`, padded with `value` at the
    end to a multiple of the group size. With `has_cls_token`, position 0 is a [CLS] token put in
    front of every slice (not counted in the padding). Differentiable."""
    group = comm.as_group(group)
    first = 1 if has_cls_token else 0
    body = x.narrow(dim, first, x.shape[dim] - first)
    length = body.shape[dim]
    extra = padded_length(length, group.size) - length
    if extra:
        shape = list(body.shape)
        shape[dim] = extra
        body = torch.cat((body, body.new_full(shape, value)), dim)
    chunk = body.shape[dim] // group.size
    mine = body.narrow(dim, group.rank * chunk, chunk)
    return torch.cat((x.narrow(dim, 0, 1), mine), dim) if first else mine


def unshard_sequence(x: Tensor, group: Any, valid_length: int, dim: int = 1, has_cls_token: bool = False) -> Tensor:
    """The whole unpadded sequence from every rank's equal slice `x` (the inverse of
    `shard_sequence`; a replicated [CLS] token is taken from this rank). Differentiable: each
    rank's gradient covers its own slice."""
    group = comm.as_group(group)
    first = 1 if has_cls_token else 0
    body = x.narrow(dim, first, x.shape[dim] - first)
    real_positions(body.shape[dim], valid_length, group)  # checks the length
    whole = gather_sequence(body, group, dim).narrow(dim, 0, valid_length)
    return torch.cat((x.narrow(dim, 0, 1), whole), dim) if first else whole
