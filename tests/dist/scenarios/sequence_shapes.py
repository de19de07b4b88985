"""Rank-side scenarios for tests/dist/sequence/test_sequence_shape_agreement.py: sequence-parallel
exchanges whose ranks hold tensors of different shapes (world 2)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from zeroshard.comm import collectives as comm
from zeroshard.sequence.gather import gather_sequence
from zeroshard.sequence.layer import DistributedAttention, _SeqAllToAll
from zeroshard.sequence.ulysses_sp import UlyssesSPAttentionHF

HEADS, DIM = 4, 8


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
    return out.transpose(1, 2)


def _hf_core(module, q, k, v, mask, *args, **kwargs):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2), None


def _error(fn) -> str:
    try:
        fn()
    except ValueError as error:
        return str(error)
    return "no error"


def mismatched_shapes(local_lengths: tuple[int, int], batches: tuple[int, int]) -> dict[str, Any]:
    """Each exchange with this rank's local length and batch: the error message of each (or
    "no error"), then a collective that must still work (the group is healthy: no mismatched
    exchange was issued)."""
    rank = dist.get_rank()
    group = comm.world_group()
    seq, batch = local_lengths[rank], batches[rank]
    q = torch.randn(batch, seq, HEADS, DIM)  # [batch, seq, heads, dim]
    out = {
        "DistributedAttention": _error(lambda: DistributedAttention(_attend, group)(q, q, q, 0)),
        "_SeqAllToAll": _error(lambda: _SeqAllToAll.apply(group, q, 2, 0, 0)),
        "gather_sequence": _error(lambda: gather_sequence(q, group, 1)),
    }
    hf = UlyssesSPAttentionHF(_hf_core, batch, HEADS, DIM, HEADS, 1, group, seq_length_is_variable=True)
    module = nn.Module()
    bhsd = q.transpose(1, 2)  # transformers' [batch, heads, seq, dim]
    out["UlyssesSPAttentionHF"] = _error(lambda: hf(module, bhsd, bhsd, bhsd, None))
    total = torch.ones(1)
    comm.all_reduce(total, group=group, tag="after")
    out["after"] = total.item()
    return out
