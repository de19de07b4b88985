"""The split Linear layers, named as DeepSpeed names them (`deepspeed.module_inject.layers`):
`LinearLayer` (column: output features split) and `LinearAllreduce` (row: input features split).

Each holds plain tensors (this rank's piece, `p.tp_split` says which: zeroshard/autotp/split.py),
so the engine packs them into flat buffers like any parameter; the exchanges are the autograd
functions of zeroshard/comm/tensor_parallel.py.

[Note: one exchange per shared input]
q, k and v (and gate and up) read the same normalised hidden states. Megatron sums their input
gradients over the group once, in front of the three; a module swap that wraps each Linear
would sum three times. `SharedInputs` gives every column layer of a model the same wrapped
input for the same input tensor (a one-entry cache, compared by identity and held weakly), so
the gradients of q, k and v meet in one autograd node and are summed over the group once: per
transformer block two all-reduces forward (o_proj, down_proj) and two backward (the attention
and MLP inputs). When the cache misses (another tensor came in between) the layer wraps its
input alone: one more all-reduce, the same numbers.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from zeroshard.comm.collectives import Group
from zeroshard.comm.tensor_parallel import (
    copy_to_tensor_parallel,
    gather_from_tensor_parallel,
    reduce_from_tensor_parallel,
)

__all__ = ["SharedInputs", "TensorParallelLayer", "TensorParallel_Layer", "LinearLayer", "LinearAllreduce"]


class SharedInputs:
    """The wrapped input of column-split layers, shared by consecutive layers reading the same
    tensor ([Note: one exchange per shared input])."""

    def __init__(self, group: Group) -> None:
        self.group = group
        self._source: weakref.ref | None = None
        # Held strongly: autograd keeps a saved input's data, not its Python object, so a weak
        # reference would die before the next layer asks. It is dropped when another input
        # comes (one activation of the model's last column input outlives its step).
        self._wrapped: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._wrapped is not None and self._source is not None and self._source() is x:
            return self._wrapped
        wrapped = copy_to_tensor_parallel(x, self.group)
        self._source, self._wrapped = weakref.ref(x), wrapped
        return wrapped


class TensorParallelLayer(nn.Module):
    """What the split layers share: the group, the piece they hold, DeepSpeed's attribute names."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, group: Group, name: str = "") -> None:
        super().__init__()
        self.weight = weight
        self.bias = bias
        self.tp_group = group
        self.name = name

    # DeepSpeed's names (TensorParallel_Layer): user code reads them.
    @property
    def tp_world_size(self) -> int:
        return self.tp_group.size

    @property
    def tp_index(self) -> int:
        return self.tp_group.rank

    @property
    def mp_group(self) -> Any:
        return self.tp_group.handle

    @property
    def in_features(self) -> int:
        return self._local_shape()[1]

    @property
    def out_features(self) -> int:
        return self._local_shape()[0]

    def _local_shape(self) -> tuple[int, ...]:
        # ds_shape: at stage 3 the parameter outside a gather is empty (zeroshard/sharding/flat.py)
        return tuple(getattr(self.weight, "ds_shape", self.weight.shape))

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"dtype={self.weight.dtype}, tp={self.tp_index}/{self.tp_world_size}")


class LinearLayer(TensorParallelLayer):
    """Column split: this rank's rows of the weight (and of the bias); the output is this rank's
    features, or, with `gather_output`, all of them."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, group: Group, inputs: SharedInputs,
                 gather_output: bool = False, name: str = "") -> None:
        super().__init__(weight, bias, group, name)
        self.gather_output = gather_output
        self._inputs = inputs

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        output = F.linear(self._inputs(input), self.weight, self.bias)
        return gather_from_tensor_parallel(output, self.tp_group) if self.gather_output else output


class LinearAllreduce(TensorParallelLayer):
    """Row split: this rank's columns of the weight, applied to this rank's input features; the
    partial outputs are summed over the group, then the (whole, replicated) bias is added."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        output = reduce_from_tensor_parallel(F.linear(input, self.weight), self.tp_group)
        return output if self.bias is None else output + self.bias


TensorParallel_Layer = TensorParallelLayer  # DeepSpeed's spelling of the base class
