"""Sequence parallelism for vision-encoder attention (AutoSP): `UlyssesSPViTAttention`.

Vision-encoder attention is not causal (every patch attends to every patch) and the wrapped
module is opaque (its q/k/v are computed inside), so the wrapper gathers the patches instead
of exchanging heads: each rank's slice is all-gathered, the original attention runs on the
whole patch sequence, and each rank keeps its own slice of the output. Everything outside
attention (MLPs, norms) stays on 1/P of the patches.

Slices may differ in length by any amount (P need not divide the patch count): lengths are
exchanged first and the padding that makes the all-gather's pieces equal is removed before
the attention sees the sequence. Equal slices of a padded sequence (`padding.shard_sequence`)
work too: inside `padding.padded_sequence(valid_length)` each rank drops its padded patches
before the gather, so padding is never a key (the mask is patched by leaving it out, which an
opaque module and Qwen2-VL's real-patch `cu_seqlens` both accept), and padded rows of the output
are zero. A `[CLS]` token (`has_cls_token=True`) is replicated: every rank holds it first in
its slice, it is put once in front of the gathered patches, and every rank gets its output.

Gradients: the gather is differentiable; a patch's input gradient is the sum over ranks of
what each rank's output slice sent back to it. A replicated CLS token's gradient on each rank
is its own rank's share, so the sum over ranks (what ZeRO's reduction takes) is the
single-device gradient.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from zeroshard.comm import collectives as comm
from zeroshard.comm.eager_regions import runs_eagerly
from zeroshard.sequence.gather import _slice_lengths, gather_sequence
from zeroshard.sequence.padding import current_valid_length, real_positions

__all__ = ["UlyssesSPViTAttention", "gather_sequence"]


class UlyssesSPViTAttention(nn.Module):
    """Wrap a vision-encoder attention module for sequence parallelism.

    Args:
        attn: the original attention; called as `attn(hidden_states, *args, **kwargs)` and
            returning the output or a tuple whose first element is the output.
        process_group: the sequence-parallel group (torch ProcessGroup or zeroshard Group).
        has_cls_token: the first token of every slice is a replicated [CLS] token.

    `hidden_states` is this rank's slice, `[batch, tokens, dim]` or `[tokens, dim]` (the
    token dim is the second to last). Tensor arguments (also inside tuples, such as rotary
    `position_embeddings`) with as many rows as the slice along that dim are gathered too.
    """

    def __init__(self, attn: nn.Module, process_group: Any, has_cls_token: bool = True) -> None:
        super().__init__()
        self.attn = attn
        self.process_group = process_group
        self.has_cls_token = has_cls_token

    @runs_eagerly("AutoSP vision attention: the sequence gathers (comm/eager_regions.py's note)")
    def forward(self, hidden_states: Tensor, *args: Any, **kwargs: Any) -> Any:
        group = comm.as_group(self.process_group)
        dim = hidden_states.dim() - 2
        local = hidden_states.shape[dim]
        first = 1 if self.has_cls_token else 0
        real = real_positions(local - first, current_valid_length(), group)  # this rank's unpadded patches

        def gathered(t: Any) -> Any:
            if isinstance(t, tuple):
                return tuple(gathered(v) for v in t)
            if torch.is_tensor(t) and t.dim() >= 2 and t.shape[t.dim() - 2] == local and t is not hidden_states:
                d = t.dim() - 2
                rest = gather_sequence(t.narrow(d, first, real), group, d)
                return torch.cat((t.narrow(d, 0, first), rest), d)
            return t

        patches = hidden_states.narrow(dim, first, real)
        full = gather_sequence(patches, group, dim)
        if first:
            full = torch.cat((hidden_states.narrow(dim, 0, 1), full), dim)
        args = tuple(gathered(a) for a in args)
        kwargs = {k: gathered(v) for k, v in kwargs.items()}
        result = self.attn(full, *args, **kwargs)
        out, extra = (result[0], tuple(result[1:])) if isinstance(result, tuple) else (result, None)
        # This rank's patches start after the CLS token and every earlier rank's patches.
        sizes = _slice_lengths(real, group, out.device)
        start = first + sum(sizes[: group.rank])
        mine = out.narrow(dim, start, real)
        if first:
            mine = torch.cat((out.narrow(dim, 0, 1), mine), dim)
        if real < local - first:  # padded patches: zero rows, so the output keeps the input's shape
            shape = list(mine.shape)
            shape[dim] = local - first - real
            mine = torch.cat((mine, mine.new_zeros(shape)), dim)
        return mine if extra is None else (mine, *extra)
