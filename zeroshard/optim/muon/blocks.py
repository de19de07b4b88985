"""How one Muon parameter is cut into the matrices Newton-Schulz orthogonalizes.

[Note: Muon blocks]
Newton-Schulz sees matrices. A parameter of full shape S is cut into `count` blocks of
`rows x cols`, each orthogonalized on its own (its own norm, its own shape factor
sqrt(max(1, rows / cols))):

    2-D [r, c]                               one r x c matrix
    N-D, N >= 3, unmarked (Conv1d, Conv2d)   one [S[0], prod(S[1:])] matrix (Muon's convention
                                             for convolutions; DeepSpeed 0.19 instead batches
                                             a 3-D conv weight over its first dimension)
    3-D marked `is_expert_group = True`      S[0] matrices S[1] x S[2] (stacked experts: AutoEP
                                             and DeepSpeed's grouped experts set the mark,
                                             Hugging Face `*Experts` stacks are marked by the
                                             presets in heads.py, a user may set it)
    2-D with heads on axis 0 (q, k, v)       H row blocks [d, c], rows h*d .. (h+1)*d
    2-D with heads on axis 1 (o)             H column blocks [r, d], columns h*d .. (h+1)*d

Heads come from parameter attributes (DeepSpeed's `muon_num_heads` and `muon_head_dim`,
plus zeroshard's `muon_head_axis`, 0 by default), which a custom model sets itself and the
presets of heads.py set on Hugging Face attention projections when `per_head_muon` is on:

    p.muon_num_heads = 8        # or p.muon_head_dim = 64; both may be given if they agree
    p.muon_head_axis = 1        # the output projection: heads are its input columns

Row blocks and expert slices are contiguous in the parameter, so every block is a task of
its own in the sharded optimizer (owner rank per block). Column blocks interleave in
memory; a column-split parameter is one task whose owner orthogonalizes its H blocks in
one batched call. Either way Newton-Schulz runs once per block per step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["BlockLayout", "HEAD_ATTRS", "block_layout", "matrix_layout", "param_block_layout"]

HEAD_ATTRS = ("muon_num_heads", "muon_head_dim", "muon_head_axis")


@dataclass(frozen=True)
class BlockLayout:
    """`count` blocks of `rows x cols`; `axis` 1 means column blocks (interleaved in memory),
    0 contiguous ones. `kind`: "matrix", "conv", "experts", "heads" (for `explain`)."""

    count: int
    rows: int
    cols: int
    axis: int = 0
    kind: str = "matrix"

    @property
    def numel(self) -> int:
        return self.count * self.rows * self.cols

    def to_blocks(self, t: torch.Tensor) -> torch.Tensor:
        """The parameter's elements (any shape, `numel` elements, row-major) as [count, rows, cols]."""
        if self.axis == 0:
            return t.reshape(self.count, self.rows, self.cols)
        return t.reshape(self.rows, self.count, self.cols).transpose(0, 1)

    def from_blocks(self, blocks: torch.Tensor) -> torch.Tensor:
        """Inverse of `to_blocks`: [count, rows, cols] back to the parameter's flat order (1-D)."""
        if self.axis == 0:
            return blocks.reshape(-1)
        return blocks.transpose(0, 1).reshape(-1)

    def describe(self) -> str:
        block = f"{self.rows}x{self.cols}"
        if self.kind == "heads":
            what = "row" if self.axis == 0 else "column"
            return f"per-head: {self.count} {what} blocks {block}"
        if self.kind == "experts":
            return f"{self.count} stacked matrices {block}"
        if self.kind == "conv":
            return f"viewed as {block}"
        return f"matrix {block}"


def matrix_layout(shape: Sequence[int], is_expert_group: bool = False) -> tuple[int, int, int]:
    """(count, rows, cols) of a parameter of full shape `shape` without heads
    (see [Note: Muon blocks])."""
    layout = block_layout(shape, is_expert_group=is_expert_group)
    return layout.count, layout.rows, layout.cols


def block_layout(
    shape: Sequence[int], is_expert_group: bool = False, num_heads: int | None = None,
    head_dim: int | None = None, head_axis: int = 0, name: str = "parameter",
) -> BlockLayout:
    """The blocks of a parameter of full shape `shape` (see [Note: Muon blocks]).

    Raises:
        ValueError: not a matrix; a stack mark on a parameter that is not 3-D; heads on a
            parameter that is not 2-D or whose axis does not divide into them.
    """
    shape = tuple(int(s) for s in shape)
    if len(shape) < 2:
        raise ValueError(f"{name}: shape {shape} is not a matrix")
    heads = num_heads is not None or head_dim is not None
    if is_expert_group and len(shape) != 3:
        raise ValueError(
            f"{name} (shape {shape}) has is_expert_group=True, which marks a stack [experts, rows, cols]; "
            "it must be 3-D. Remove the mark, or stack the expert matrices on the first dimension."
        )
    if heads:
        return _head_layout(shape, num_heads, head_dim, head_axis, is_expert_group, name)
    if len(shape) == 2:
        return BlockLayout(1, shape[0], shape[1])
    if is_expert_group:
        return BlockLayout(shape[0], shape[1], shape[2], kind="experts")
    return BlockLayout(1, shape[0], math.prod(shape[1:]), kind="conv")


def _head_layout(
    shape: tuple[int, ...], num_heads: int | None, head_dim: int | None, axis: int, stacked: bool, name: str,
) -> BlockLayout:
    fix = ("Set muon_num_heads (or muon_head_dim) and muon_head_axis to match the weight, or set them to None "
           "to orthogonalize it whole.")
    if len(shape) != 2 or stacked:
        raise ValueError(f"{name} (shape {shape}) has per-head Muon attributes, but heads split a 2-D weight. {fix}")
    for attr, value in (("muon_num_heads", num_heads), ("muon_head_dim", head_dim)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name}: {attr}={value!r} must be a positive integer. {fix}")
    if axis not in (0, 1):
        raise ValueError(f"{name}: muon_head_axis={axis!r} must be 0 (rows: q, k, v) or 1 (columns: o). {fix}")
    size = shape[axis]
    if num_heads is None:
        assert head_dim is not None
        num_heads = size // head_dim
    width = size // num_heads
    if num_heads * width != size or (head_dim is not None and head_dim != width):
        given = f"muon_num_heads={num_heads}" if head_dim is None else f"muon_head_dim={head_dim}"
        raise ValueError(
            f"{name} (shape {shape}): {given} does not divide axis {axis} ({size}) into whole heads. {fix}"
        )
    if axis == 0:
        return BlockLayout(num_heads, width, shape[1], 0, "heads")
    return BlockLayout(num_heads, shape[0], width, 1, "heads")


def _attr(p: Any, key: str) -> Any:
    return getattr(p, key, None)


def param_block_layout(name: str, p: torch.Tensor, shape: Sequence[int] | None = None) -> BlockLayout:
    """`block_layout` from a parameter's marks (`is_expert_group`, the head attributes) and
    its full shape (`shape`, default the parameter's own or its ds_shape)."""
    if shape is None:
        shape = tuple(getattr(p, "ds_shape", p.shape)) if p.numel() == 0 else tuple(p.shape)
    axis = _attr(p, "muon_head_axis")
    return block_layout(
        shape, bool(_attr(p, "is_expert_group")), _attr(p, "muon_num_heads"), _attr(p, "muon_head_dim"),
        0 if axis is None else axis, name,
    )
