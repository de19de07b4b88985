"""Ulysses sequence parallelism: attention over the whole sequence, for a slice of the heads.

Each of the P ranks of a sequence group holds 1/P of every sample's sequence. Attention needs
the whole sequence, but its heads are independent, so `DistributedAttention` trades the split:
an all-to-all scatters the heads and gathers the sequence (each rank then holds every position
for about H/P heads), any local attention runs on that, and the inverse all-to-all gives each
rank its own positions back with every head. Backward of an all-to-all is the all-to-all the
other way: zeroshard/comm/exchange.py's one differentiable exchange does both, and this file
only lays out the rows (heads one way, sequence chunks the other).

Layouts follow DeepSpeed's convention: dims 0 and 1 are batch and sequence (`batch_dim_idx`
says which is the batch), and the heads dimension is whichever of `scatter_idx`/`gather_idx`
is >= 2. `scatter_idx >= 2` scatters heads and gathers the sequence; the inverse call swaps
the two indices.

Every rank of the group must hold the same shapes (an equal slice of the same samples): the
exchange's sizes come from them. `DistributedAttention` and a direct `_SeqAllToAll` call check
that first, by one small all-gather of the shapes (zeroshard/sequence/shapes.py), so ranks with
different local lengths or batches get a ValueError on every rank instead of an abort in the
all-to-all.

Heads need not divide P, as in DeepSpeed 0.19.8 (`uneven_heads_all2all`): the heads are split
by key/value group, the first `KV % P` ranks taking one group more, each group with its
`H / KV` query heads, so a grouped-query group never crosses ranks (3 heads over 2 ranks: 2 and
1; 6 query heads over 3 key/value heads: 4 + 2 query heads, 2 + 1 key/value heads), and the
all-to-all moves uneven chunks (`head_split`). With fewer key/value heads than ranks, which
DeepSpeed refuses, each rank receives the key/value heads its query heads use (a key/value head
is sent to several ranks, which is exact: their gradients sum back through the selection).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from zeroshard.comm import collectives as comm
from zeroshard.comm.eager_regions import runs_eagerly
from zeroshard.comm.exchange import all_to_all_many
from zeroshard.sequence.shapes import agree_shapes

__all__ = [
    "DistributedAttention",
    "_SeqAllToAll",
    "exchange_heads",
    "exchange_overlapped",
    "head_counts",
    "head_split",
    "heads_to_sequence",
    "kv_selection",
    "sequence_to_heads",
    "single_all_to_all",
    "uneven_heads_all2all",
]


def head_counts(num_heads: int, world: int) -> list[int]:
    """Heads per rank when `num_heads` heads are split over `world` ranks: equal shares, the
    first `num_heads % world` ranks one more."""
    base, extra = divmod(num_heads, world)
    return [base + (r < extra) for r in range(world)]


def _to_sequence(x: Tensor, group: comm.Group, head_dim: int, seq_dim: int, counts: list[int]):
    """The rows, splits and reshaping of `heads_to_sequence`."""
    world, mine = group.size, counts[group.rank]
    send = x.movedim(head_dim, 0)  # (H, *rest): rank j's heads are consecutive rows

    def finish(recv: Tensor) -> Tensor:
        # (P * h, *rest) -> (P, *x's dims with h heads); then P joins the sequence it came from.
        out = recv.view(world, mine, *send.shape[1:]).movedim(1, 1 + head_dim)
        return out.movedim(0, seq_dim).flatten(seq_dim, seq_dim + 1)

    return send, list(counts), [mine] * world, finish


def _to_heads(x: Tensor, group: comm.Group, head_dim: int, seq_dim: int, counts: list[int]):
    """The rows, splits and reshaping of `sequence_to_heads`."""
    world = group.size
    seq = x.shape[seq_dim]
    if seq % world:
        raise ValueError(f"sequence length {seq} is not divisible by the sequence-parallel size {world}")
    chunk = x.unflatten(seq_dim, (world, seq // world)).movedim(seq_dim, 0)  # (P, *x's dims)
    per_head = chunk[0].numel() // max(counts[group.rank], 1)
    recv_rows = [c * per_head for c in counts]

    def finish(recv: Tensor) -> Tensor:
        shape = list(chunk.shape[1:])
        pieces = []
        for part, count in zip(recv.split(recv_rows), counts, strict=True):
            shape[head_dim] = count
            pieces.append(part.view(shape))
        return torch.cat(pieces, dim=head_dim)

    return chunk.reshape(-1), None, recv_rows, finish


def exchange_overlapped(
    items: list[tuple[Tensor, list[int]]],
    group: comm.Group,
    head_dim: int,
    seq_dim: int,
    to_sequence: bool,
    stream: Any = None,
) -> list[Tensor]:
    """Several head/sequence exchanges (query, key, value) at once, differentiably; results in
    order. One exchange of zeroshard/comm/exchange.py carries them all: issued together (with a
    CUDA `stream`, DeepSpeed's `sp_stream`, every tensor but the first on that side stream), and
    their gradients go back together the same way; the numbers do not depend on the stream."""
    if group.size == 1:  # nothing moves: every rank's heads and sequence are its own
        return [x for x, _ in items]
    prepare = _to_sequence if to_sequence else _to_heads
    prepared = [prepare(x, group, head_dim, seq_dim, counts) for x, counts in items]
    received = all_to_all_many([(send, out, into) for send, out, into, _ in prepared], group, "sequence", stream)
    return [finish(recv) for (_, _, _, finish), recv in zip(prepared, received, strict=True)]


def heads_to_sequence(x: Tensor, group: comm.Group, head_dim: int, seq_dim: int, counts: list[int]) -> Tensor:
    """Every head on this rank's sequence chunk -> `counts[rank]` heads on the whole sequence
    (differentiable: its gradient is `sequence_to_heads` of the gradient).

    `x` holds sum(counts) heads; rank j receives heads [sum(counts[:j]), sum(counts[:j+1])).
    The sequence is gathered in group-rank order along `seq_dim`.
    """
    return exchange_overlapped([(x, counts)], group, head_dim, seq_dim, True)[0]


def sequence_to_heads(x: Tensor, group: comm.Group, head_dim: int, seq_dim: int, counts: list[int]) -> Tensor:
    """`counts[rank]` heads on the whole sequence -> every head on this rank's sequence chunk
    (the inverse of `heads_to_sequence` with the same `counts`; differentiable)."""
    return exchange_overlapped([(x, counts)], group, head_dim, seq_dim, False)[0]


def exchange_heads(
    x: Tensor, group: comm.Group, head_dim: int, seq_dim: int, counts: list[int], to_sequence: bool
) -> Tensor:
    """`heads_to_sequence` (`to_sequence=True`) or `sequence_to_heads`, for any layout (the
    Hugging Face integration's [batch, heads, seq, dim] among them)."""
    return exchange_overlapped([(x, counts)], group, head_dim, seq_dim, to_sequence)[0]


def _dims(scatter_idx: int, gather_idx: int, batch_dim_idx: int) -> tuple[int, int]:
    if batch_dim_idx not in (0, 1):
        raise ValueError(
            f"batch_dim_idx={batch_dim_idx}: must be 0 ([batch, seq, heads, ...]) or 1 ([seq, batch, heads, ...])"
        )
    head_dim = max(scatter_idx, gather_idx)
    if head_dim < 2:
        raise ValueError(
            f"scatter_idx={scatter_idx}, gather_idx={gather_idx}: one of them must name the heads dimension (>= 2); "
            "dims 0 and 1 are batch and sequence"
        )
    return head_dim, 1 - batch_dim_idx


def split_counts(total: int, num_kv_heads: int | None, world: int) -> list[int]:
    """Heads per rank after scattering `total` heads over `world` ranks, as DeepSpeed 0.19.8's
    exchange splits them: evenly when `world` divides them and no key/value count is given;
    otherwise by key/value group (`num_kv_heads`, or `total` itself: one group per head), rank r
    taking `total / num_kv_heads` heads for each of its `head_counts(num_kv_heads, world)[r]`
    groups."""
    if num_kv_heads is None:
        if total % world == 0:
            return [total // world] * world
        num_kv_heads = total
    if num_kv_heads < world:
        raise ValueError(
            f"num_kv_heads={num_kv_heads} is less than the sequence-parallel size {world}: a rank would have no "
            "key/value head of its own (DeepSpeed refuses it too). DistributedAttention handles it (each rank "
            "receives the key/value heads its query heads use); or use a sequence-parallel size of at most "
            f"{num_kv_heads}."
        )
    if total % num_kv_heads:
        return head_counts(total, world)  # DeepSpeed's near-even split for a count that is not per group
    return [total // num_kv_heads * kv for kv in head_counts(num_kv_heads, world)]


def head_split(num_q: int, num_kv: int, world: int) -> tuple[list[int], list[int], list[int] | None]:
    """(query heads per rank, key/value heads per rank, the key/value heads sent, in rank order,
    or None for the plain split) for attention with `num_q` query and `num_kv` key/value heads
    over `world` ranks: DeepSpeed's split by key/value group when there are at least as many
    key/value heads as ranks (`split_counts`), else `kv_selection`."""
    if num_q % num_kv:
        raise ValueError(f"{num_q} query heads are not a multiple of {num_kv} key/value heads")
    if num_kv >= world:
        kv_counts = split_counts(num_kv, num_kv, world)
        return [num_q // num_kv * kv for kv in kv_counts], kv_counts, None
    selection, kv_counts = kv_selection(num_q, num_kv, world)
    return head_counts(num_q, world), kv_counts, selection


class _SeqAllToAll:
    """The differentiable all-to-all between a sequence split and a head split, under DeepSpeed's
    name.

    `apply(group, input, scatter_idx, gather_idx, batch_dim_idx, stream=None, handle=None,
    type=None, is_fwd=True, num_kv_heads=None)`: DeepSpeed 0.19.8's positional signature. Head
    counts the group size does not divide are split as DeepSpeed splits them (`split_counts`): in
    the scatter direction from the input's heads and `num_kv_heads`, in the gather direction
    from the heads each rank holds (they may differ by rank; checked against `num_kv_heads` when
    given). zeroshard also takes the per-rank head counts themselves as a list in
    `num_kv_heads`'s place. `stream`, `handle`, `type` and `is_fwd` are accepted for
    compatibility; the collective runs on the current stream. Its gradient is the exchange the
    other way (zeroshard/comm/exchange.py).
    """

    @staticmethod
    def apply(
        group: Any,
        input: Tensor,
        scatter_idx: int,
        gather_idx: int,
        batch_dim_idx: int,
        stream: Any = None,
        handle: Any = None,
        type: Any = None,
        is_fwd: bool = True,
        num_kv_heads: int | list[int] | None = None,
    ) -> Tensor:
        group = comm.as_group(group)
        head_dim, seq_dim = _dims(scatter_idx, gather_idx, batch_dim_idx)
        scatters_heads = scatter_idx >= 2
        what = "Ulysses all-to-all (_SeqAllToAll)"
        if isinstance(num_kv_heads, list | tuple):  # the counts themselves
            counts = list(num_kv_heads)
        elif scatters_heads:  # every rank holds every head: the shapes must agree
            agree_shapes({"input": input}, group, what, _EQUAL_SLICES)
            counts = split_counts(input.shape[head_dim], num_kv_heads, group.size)
        else:  # each rank holds its own heads: all but the head dimension must agree
            shapes = agree_shapes({"input": input}, group, what, _EQUAL_SLICES, vary_dim=head_dim)
            counts = [rank[0][head_dim] for rank in shapes]
            if num_kv_heads is not None and counts != split_counts(sum(counts), num_kv_heads, group.size):
                raise ValueError(
                    f"{what} over ranks {list(group.ranks)}: the ranks hold {counts} heads, not the split of "
                    f"{sum(counts)} heads by num_kv_heads={num_kv_heads} "
                    f"({split_counts(sum(counts), num_kv_heads, group.size)}). Pass the num_kv_heads the scatter used."
                )
        return exchange_heads(input, group, head_dim, seq_dim, counts, scatters_heads)


def single_all_to_all(
    input: Tensor, scatter_idx: int, gather_idx: int, batch_dim_idx: int, group: Any, async_op: bool = False,
    handle: Any = None, type: Any = None, num_kv_heads: int | None = None,
) -> Tensor:
    """DeepSpeed's low-level exchange (`deepspeed.sequence.layer.single_all_to_all`), uneven
    head counts included; here it is `_SeqAllToAll.apply` (differentiable). Synchronous: for
    overlap, give `DistributedAttention` an `sp_stream`."""
    if async_op:
        raise ValueError(
            "single_all_to_all(async_op=True): zeroshard's exchange is synchronous and fills no overlap handle. "
            "Pass async_op=False, or let DistributedAttention(sp_stream=...) overlap the query, key and value."
        )
    return _SeqAllToAll.apply(group, input, scatter_idx, gather_idx, batch_dim_idx, None, handle, type, True,
                              num_kv_heads)


def uneven_heads_all2all(
    input: Tensor, scatter_idx: int, gather_idx: int, batch_dim_idx: int, group: Any, num_kv_heads: int
) -> Tensor:
    """DeepSpeed 0.19.8's exchange for head counts the group size does not divide (`single_all_to_all`
    with `num_kv_heads`)."""
    return single_all_to_all(input, scatter_idx, gather_idx, batch_dim_idx, group, num_kv_heads=num_kv_heads)


def kv_selection(num_q: int, num_kv: int, world: int) -> tuple[list[int] | None, list[int]]:
    """Which key/value heads each rank needs, concatenated in rank order, and how many per rank.

    Returns (None, counts) when the plain head split already gives every rank exactly its
    query heads' key/value heads. Otherwise each rank gets the distinct key/value heads its
    query heads use, provided its local query heads then map onto them as grouped-query
    attention expects (local query head i uses local key/value head i // (q_r / kv_r));
    failing that, one key/value head per query head (plain multi-head attention, always exact).
    """
    if num_q % num_kv:
        raise ValueError(f"{num_q} query heads are not a multiple of {num_kv} key/value heads")
    group_size = num_q // num_kv
    q_counts = head_counts(num_q, world)
    starts = [sum(q_counts[:r]) for r in range(world)]
    selection: list[int] = []
    kv_counts: list[int] = []
    for start, count in zip(starts, q_counts, strict=True):
        used = [q // group_size for q in range(start, start + count)]
        distinct = sorted(set(used))
        ratio, uneven = divmod(count, len(distinct))
        if uneven or any(used[i] != distinct[i // ratio] for i in range(count)):
            return [q // group_size for q in range(num_q)], q_counts
        selection += distinct
        kv_counts.append(len(distinct))
    if selection == list(range(num_kv)):
        return None, kv_counts
    return selection, kv_counts


_EQUAL_SLICES = (
    "Every rank of a sequence-parallel group must hold an equal slice of the same samples: pad the whole "
    "sequence to a multiple of the group size and shard it (UlyssesSPDataLoaderAdapter, or "
    "zeroshard.sequence.padding.shard_sequence), and give the group's ranks the same batch."
)


def _rotate_half(x: Tensor) -> Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


class DistributedAttention(torch.nn.Module):
    """Ulysses attention around any local attention.

    Args:
        local_attention: called as `local_attention(q, k, v, *args, **kwargs)` on the whole
            sequence for this rank's heads, in the input layout.
        sequence_process_group: the sequence-parallel group (a `zeroshard.comm.Group` or a
            torch ProcessGroup).
        scatter_idx: the heads dimension (scattered on the way in).
        gather_idx: DeepSpeed's gather index; the sequence dimension is the one of 0, 1 that
            `batch_dim_idx` does not name.
        sp_stream: a side CUDA stream (DeepSpeed's): the key and value all-to-alls run on it while
            the query's runs on the current stream (forward and backward). Ignored for CPU
            tensors, where the three all-to-alls are always issued asynchronously together.
        num_kv_heads: the key/value head count, checked against `key` when given.
    """

    def __init__(
        self,
        local_attention: Any,
        sequence_process_group: Any,
        scatter_idx: int = 2,
        gather_idx: int = 0,
        sp_stream: Any = None,
        num_kv_heads: int | None = None,
    ) -> None:
        super().__init__()
        self.local_attn = local_attention
        self.spg = sequence_process_group
        self.scatter_idx = scatter_idx
        self.gather_idx = gather_idx
        self.sp_stream = sp_stream
        self.num_kv_heads = num_kv_heads

    @runs_eagerly("Ulysses attention: the shape agreement and the head/sequence exchanges (eager_regions.py's note)")
    def forward(
        self, query: Tensor, key: Tensor, value: Tensor, batch_dim_idx: int, rotary_pos_emb: Any = None, *args, **kwargs
    ) -> Tensor:
        """q, k, v: this rank's sequence chunk with every head -> the attention output there.

        `rotary_pos_emb`: optional (cos, sin) for the whole sequence, batch-first
        ([batch or 1, seq, heads or 1, rotary dim]); applied (rotate-half convention) to the
        gathered query and key before the local attention.
        """
        group = comm.as_group(self.spg)
        # Every exchange below (and its gradient) is sized by these shapes.
        agree_shapes({"query": query, "key": key, "value": value}, group, "Ulysses attention (DistributedAttention)",
                     _EQUAL_SLICES)
        head_dim = self.scatter_idx
        num_q, num_kv = query.shape[head_dim], key.shape[head_dim]
        if self.num_kv_heads is not None and num_kv != self.num_kv_heads:
            raise ValueError(f"num_kv_heads={self.num_kv_heads}, but key has {num_kv} heads in dim {head_dim}")
        if num_q < group.size:
            raise ValueError(
                f"{num_q} attention heads cannot be split over {group.size} sequence-parallel ranks: "
                "use a sequence-parallel size of at most the head count"
            )
        q_counts, kv_counts, selection = head_split(num_q, num_kv, group.size)
        if selection is not None:
            index = torch.tensor(selection, device=key.device)
            key, value = key.index_select(head_dim, index), value.index_select(head_dim, index)

        _, seq_dim = _dims(self.scatter_idx, self.gather_idx, batch_dim_idx)
        q, k, v = exchange_overlapped(
            [(query, q_counts), (key, kv_counts), (value, kv_counts)], group, head_dim, seq_dim, True, self.sp_stream
        )
        if rotary_pos_emb is not None:
            cos, sin = (f.transpose(0, 1) if batch_dim_idx == 1 else f for f in rotary_pos_emb)
            q = _apply_rotary(q, cos, sin)
            k = _apply_rotary(k, cos, sin)
        context = self.local_attn(q, k, v, *args, **kwargs)
        return exchange_heads(context, group, head_dim, seq_dim, q_counts, False)


def _apply_rotary(t: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    rotary = cos.shape[-1]
    rotated, rest = t[..., :rotary], t[..., rotary:]
    rotated = rotated * cos + _rotate_half(rotated) * sin
    return torch.cat((rotated, rest), dim=-1) if rest.shape[-1] else rotated
