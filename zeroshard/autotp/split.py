"""Where a tensor-parallel shard sits in the whole tensor: `TensorSplit`.

[Note: tensor-parallel splits]
A split parameter holds one of `parts` equal pieces of its whole tensor along `dim`. When the
weight packs sub-parameters along that dimension (a fused [q; k; v], a packed [gate; up]), each
sub-parameter is cut on its own and a rank's piece is its slice of every sub-parameter, in
order: with `sub_sizes` (4, 2, 2) and 2 parts, rank 0 holds rows [0:2] + [4:5] + [6:7] of q, k
and v. Splits are even (every size divisible by `parts`): every rank of a tensor-parallel group
then holds flats of the same layout, which is what lets a row-split and a column-split
parameter, the flats, the checkpoints and Muon treat all ranks alike.

The split is kept on the parameter as `p.tp_split` (zeroshard/autotp/transform.py) and read by
the checkpoint (a whole tensor is saved as its pieces, loaded at any tensor-parallel size), the
16-bit export (pieces gathered over the group), `explain` and Muon.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["TensorSplit", "tensor_split_of"]


@dataclass(frozen=True)
class TensorSplit:
    """One piece of a whole tensor (see [Note: tensor-parallel splits]).

    Attributes:
        dim: the dimension split.
        parts: the number of pieces (the tensor-parallel size).
        index: this piece's position (the rank's index in its tensor-parallel group).
        full_shape: the whole tensor's shape.
        sub_sizes: the sizes of the packed sub-parameters along `dim` (None: one).
    """

    dim: int
    parts: int
    index: int
    full_shape: tuple[int, ...]
    sub_sizes: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        length = self.full_shape[self.dim]
        sizes = self.sub_sizes or (length,)
        if sum(sizes) != length or any(s % self.parts for s in sizes):
            raise ValueError(
                f"a tensor of shape {list(self.full_shape)} cannot be split evenly into {self.parts} pieces along "
                f"dim {self.dim}" + (f" (sub-parameters {list(sizes)})" if self.sub_sizes else "")
            )

    @property
    def segments(self) -> list[tuple[int, int]]:
        """(start in the whole tensor, length) along `dim` of every slice this piece holds."""
        sizes = self.sub_sizes or (self.full_shape[self.dim],)
        out, start = [], 0
        for size in sizes:
            step = size // self.parts
            out.append((start + self.index * step, step))
            start += size
        return out

    @property
    def local_shape(self) -> tuple[int, ...]:
        shape = list(self.full_shape)
        shape[self.dim] //= self.parts
        return tuple(shape)

    def with_index(self, index: int) -> TensorSplit:
        return TensorSplit(self.dim, self.parts, index, self.full_shape, self.sub_sizes)

    def piece_of(self, whole: torch.Tensor) -> torch.Tensor:
        """This piece of `whole` (a new contiguous tensor)."""
        slices = [whole.narrow(self.dim, start, length) for start, length in self.segments]
        return torch.cat(slices, dim=self.dim).contiguous() if len(slices) > 1 else slices[0].contiguous()

    def assemble(self, pieces: list[torch.Tensor]) -> torch.Tensor:
        """The whole tensor from every piece, in index order."""
        if len(pieces) != self.parts:
            raise ValueError(f"{len(pieces)} pieces for a split into {self.parts}")
        whole = pieces[0].new_empty(self.full_shape)
        for index, piece in enumerate(pieces):
            at = 0
            for start, length in self.with_index(index).segments:
                whole.narrow(self.dim, start, length).copy_(piece.narrow(self.dim, at, length))
                at += length
        return whole

    # -- the checkpoint's description (index.json): no index, the same for every piece
    def to_json(self) -> dict[str, Any]:
        return {"dim": self.dim, "parts": self.parts, "sub_sizes": list(self.sub_sizes) if self.sub_sizes else None}

    @classmethod
    def from_json(cls, entry: dict[str, Any], full_shape: list[int], index: int = 0) -> TensorSplit:
        sub = entry.get("sub_sizes")
        return cls(int(entry["dim"]), int(entry["parts"]), index, tuple(int(s) for s in full_shape),
                   tuple(int(s) for s in sub) if sub else None)


def tensor_split_of(p: Any) -> TensorSplit | None:
    """The split a parameter holds (None: whole)."""
    return getattr(p, "tp_split", None)
