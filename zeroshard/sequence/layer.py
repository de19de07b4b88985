"""Ulysses sequence parallelism: attention over the whole sequence, for a slice of the heads.

Each of the P ranks of a sequence group holds 1/P of every sample's sequence. Attention needs
the whole sequence, but its heads are independent, so `DistributedAttention` trades the split:
an all-to-all scatters the heads and gathers the sequence (each rank then holds every position
for about H/P heads), any local attention runs on that, and the inverse all-to-all gives each
rank its own positions back with every head. Backward of an all-to-all is the all-to-all the
other way, so autograd only has to swap the two directions (`_SeqAllToAll`).

Layouts follow DeepSpeed's convention: dims 0 and 1 are batch and sequence (`batch_dim_idx`
says which is the batch), and the heads dimension is whichever of `scatter_idx`/`gather_idx`
is >= 2. `scatter_idx >= 2` scatters heads and gathers the sequence; the inverse call swaps
the two indices.

Every rank of the group must hold the same shapes (an equal slice of the same samples): the
exchange's sizes come from them. `DistributedAttention` and a direct `_SeqAllToAll` call check
that first, by one small all-gather of the shapes (zeroshard/sequence/shapes.py), so ranks with
different local lengths or batches get a ValueError on every rank instead of an abort in the
all-to-all.

Heads need not divide P: the first `H % P` ranks take one extra head, and the all-to-all moves
uneven chunks. Grouped-query attention keeps its key/value heads shared: each rank receives
the key/value heads its query heads use (a key/value head is sent to several ranks when there
are fewer of them than ranks, which is exact: their gradients sum back through the selection).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from zeroshard.comm import collectives as comm
from zeroshard.sequence.shapes import agree_shapes

__all__ = [
    "DistributedAttention",
    "_SeqAllToAll",
    "exchange_heads",
    "exchange_overlapped",
    "head_counts",
    "heads_to_sequence",
    "kv_selection",
    "sequence_to_heads",
]


def head_counts(num_heads: int, world: int) -> list[int]:
    """Heads per rank when `num_heads` heads are split over `world` ranks: equal shares, the
    first `num_heads % world` ranks one more."""
    base, extra = divmod(num_heads, world)
    return [base + (r < extra) for r in range(world)]


class _InFlight:
    """An all-to-all issued but maybe not finished: `result()` waits and shapes what arrived."""

    def __init__(self, recv: Tensor, work: Any, finish: Any) -> None:
        self.recv, self.work, self.finish = recv, work, finish

    def result(self) -> Tensor:
        if self.work is not None:
            self.work.wait()
        return self.finish(self.recv)


def start_heads_to_sequence(
    x: Tensor, group: comm.Group, head_dim: int, seq_dim: int, counts: list[int], async_op: bool = False
) -> _InFlight:
    """Issue `heads_to_sequence` (asynchronously with `async_op`); `.result()` gives its output."""
    world, mine = group.size, counts[group.rank]
    send = x.movedim(head_dim, 0).contiguous()  # (H, *rest): rank j's heads are consecutive rows
    recv = send.new_empty((world * mine, *send.shape[1:]))
    work = comm.all_to_all_single(
        recv, send, [mine] * world, list(counts), group=group, tag="sequence", async_op=async_op
    )

    def finish(recv: Tensor) -> Tensor:
        # (P * h, *rest) -> (P, *x's dims with h heads); then P joins the sequence it came from.
        out = recv.view(world, mine, *send.shape[1:]).movedim(1, 1 + head_dim)
        return out.movedim(0, seq_dim).flatten(seq_dim, seq_dim + 1)

    return _InFlight(recv, work if async_op else None, finish)


def heads_to_sequence(x: Tensor, group: comm.Group, head_dim: int, seq_dim: int, counts: list[int]) -> Tensor:
    """Every head on this rank's sequence chunk -> `counts[rank]` heads on the whole sequence.

    `x` holds sum(counts) heads; rank j receives heads [sum(counts[:j]), sum(counts[:j+1])).
    The sequence is gathered in group-rank order along `seq_dim`.
    """
    return start_heads_to_sequence(x, group, head_dim, seq_dim, counts).result()


def start_sequence_to_heads(
    x: Tensor, group: comm.Group, head_dim: int, seq_dim: int, counts: list[int], async_op: bool = False
) -> _InFlight:
    """Issue `sequence_to_heads` (asynchronously with `async_op`); `.result()` gives its output."""
    world = group.size
    seq = x.shape[seq_dim]
    if seq % world:
        raise ValueError(f"sequence length {seq} is not divisible by the sequence-parallel size {world}")
    chunk = x.unflatten(seq_dim, (world, seq // world)).movedim(seq_dim, 0).contiguous()  # (P, *x's dims)
    per_head = chunk[0].numel() // max(counts[group.rank], 1)
    recv = x.new_empty(sum(counts) * per_head)
    work = comm.all_to_all_single(
        recv, chunk.view(-1), [c * per_head for c in counts], None, group=group, tag="sequence", async_op=async_op
    )

    def finish(recv: Tensor) -> Tensor:
        shape = list(chunk.shape[1:])
        pieces = []
        for part, count in zip(recv.split([c * per_head for c in counts]), counts, strict=True):
            shape[head_dim] = count
            pieces.append(part.view(shape))
        return torch.cat(pieces, dim=head_dim)

    return _InFlight(recv, work if async_op else None, finish)


def sequence_to_heads(x: Tensor, group: comm.Group, head_dim: int, seq_dim: int, counts: list[int]) -> Tensor:
    """`counts[rank]` heads on the whole sequence -> every head on this rank's sequence chunk
    (the inverse of `heads_to_sequence` with the same `counts`)."""
    return start_sequence_to_heads(x, group, head_dim, seq_dim, counts).result()


def exchange_overlapped(
    items: list[tuple[Tensor, list[int]]],
    group: comm.Group,
    head_dim: int,
    seq_dim: int,
    to_sequence: bool,
    stream: Any = None,
) -> list[Tensor]:
    """Several head/sequence exchanges (query, key, value), overlapped; results in order.

    With a CUDA `stream` (DeepSpeed's `sp_stream`) and CUDA tensors, the first item's exchange
    runs on the current stream while the others run on `stream`: the side stream first waits
    for the current one (the inputs were made there), the current one waits for the side
    stream before the results are used, and `record_stream` keeps each tensor that crosses
    streams alive until the stream using it is done. Otherwise (CPU, or no stream) every
    exchange is issued asynchronously and then waited for in order, so gloo moves them
    concurrently; the numbers are the same either way.
    """
    start = start_heads_to_sequence if to_sequence else start_sequence_to_heads
    first = items[0][0]
    if stream is not None and first.is_cuda and isinstance(stream, torch.cuda.Stream):
        current = torch.cuda.current_stream(first.device)
        stream.wait_stream(current)
        with torch.cuda.stream(stream):
            side = [start(t, group, head_dim, seq_dim, counts, async_op=True) for t, counts in items[1:]]
            for t, _ in items[1:]:
                t.record_stream(stream)
        mine = start(first, group, head_dim, seq_dim, items[0][1]).result()
        with torch.cuda.stream(stream):
            side_results = [flight.result() for flight in side]
        current.wait_stream(stream)
        for result in side_results:
            result.record_stream(current)
        return [mine, *side_results]
    flights = [start(t, group, head_dim, seq_dim, counts, async_op=True) for t, counts in items]
    return [flight.result() for flight in flights]


class _QKVExchange(torch.autograd.Function):
    """Query, key and value to (or from) the head split in one overlapped step; the backward
    is the overlapped inverse exchange of their gradients."""

    @staticmethod
    def forward(
        ctx: Any,
        group: comm.Group,
        head_dim: int,
        seq_dim: int,
        counts: tuple[list[int], ...],
        stream: Any,
        *tensors: Tensor,
    ) -> tuple[Tensor, ...]:
        ctx.args = (group, head_dim, seq_dim, counts, stream)
        items = list(zip(tensors, counts, strict=True))
        return tuple(exchange_overlapped(items, group, head_dim, seq_dim, True, stream))

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Any, ...]:
        group, head_dim, seq_dim, counts, stream = ctx.args
        grads_in = exchange_overlapped(
            [(g.contiguous(), c) for g, c in zip(grads, counts, strict=True)], group, head_dim, seq_dim, False, stream
        )
        return (None, None, None, None, None, *grads_in)


class _HeadSequenceExchange(torch.autograd.Function):
    """`heads_to_sequence` (to_sequence) or `sequence_to_heads`, with the dims named; the
    backward is the other one."""

    @staticmethod
    def forward(
        ctx: Any, group: comm.Group, x: Tensor, head_dim: int, seq_dim: int, counts: list[int], to_sequence: bool
    ) -> Tensor:
        ctx.args = (group, head_dim, seq_dim, counts, not to_sequence)
        exchange = heads_to_sequence if to_sequence else sequence_to_heads
        return exchange(x, group, head_dim, seq_dim, counts)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Any, ...]:
        group, head_dim, seq_dim, counts, to_sequence = ctx.args
        grad_input = _HeadSequenceExchange.apply(group, grad, head_dim, seq_dim, counts, to_sequence)
        return None, grad_input, None, None, None, None


def exchange_heads(
    x: Tensor, group: comm.Group, head_dim: int, seq_dim: int, counts: list[int], to_sequence: bool
) -> Tensor:
    """Differentiable `heads_to_sequence` (`to_sequence=True`) or `sequence_to_heads`, for any
    layout (the Hugging Face integration's [batch, heads, seq, dim] among them)."""
    return _HeadSequenceExchange.apply(group, x, head_dim, seq_dim, counts, to_sequence)


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


class _SeqAllToAll(torch.autograd.Function):
    """The differentiable all-to-all between a sequence split and a head split.

    `apply(group, input, scatter_idx, gather_idx, batch_dim_idx, stream=None, handle=None,
    type=None, is_fwd=True, counts=None)`: DeepSpeed's positional signature, plus the heads
    each rank holds after scattering them (None: an even split; `DistributedAttention` passes
    `head_counts(H, P)` so that uneven head counts work in both directions). `stream`,
    `handle`, `type` and `is_fwd` are accepted for compatibility; the collective runs on the
    current stream.
    """

    @staticmethod
    def forward(
        ctx: Any,
        group: Any,
        input: Tensor,
        scatter_idx: int,
        gather_idx: int,
        batch_dim_idx: int,
        stream: Any = None,
        handle: Any = None,
        type: Any = None,
        is_fwd: bool = True,
        counts: list[int] | None = None,
    ) -> Tensor:
        group = comm.as_group(group)
        head_dim, seq_dim = _dims(scatter_idx, gather_idx, batch_dim_idx)
        scatters_heads = scatter_idx >= 2
        if counts is None:  # a direct call (DistributedAttention passes counts, its shapes agreed)
            agree_shapes({"input": input}, group, "Ulysses all-to-all (_SeqAllToAll)", _EQUAL_SLICES)
            # every rank holds the same number of heads after the exchange
            total = input.shape[head_dim] * (1 if scatters_heads else group.size)
            counts = head_counts(total, group.size)
        ctx.args = (group, scatter_idx, gather_idx, batch_dim_idx, counts)
        if scatters_heads:
            return heads_to_sequence(input, group, head_dim, seq_dim, counts)
        return sequence_to_heads(input, group, head_dim, seq_dim, counts)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Any, ...]:
        group, scatter_idx, gather_idx, batch_dim_idx, counts = ctx.args
        grad_input = _SeqAllToAll.apply(
            group, grad, gather_idx, scatter_idx, batch_dim_idx, None, None, None, False, counts
        )
        return (None, grad_input) + (None,) * 8


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
        q_counts = head_counts(num_q, group.size)
        selection, kv_counts = kv_selection(num_q, num_kv, group.size)
        if selection is not None:
            index = torch.tensor(selection, device=key.device)
            key, value = key.index_select(head_dim, index), value.index_select(head_dim, index)

        _, seq_dim = _dims(self.scatter_idx, self.gather_idx, batch_dim_idx)
        q, k, v = _QKVExchange.apply(
            group, head_dim, seq_dim, (q_counts, kv_counts, kv_counts), self.sp_stream, query, key, value
        )
        if rotary_pos_emb is not None:
            cos, sin = (f.transpose(0, 1) if batch_dim_idx == 1 else f for f in rotary_pos_emb)
            q = _apply_rotary(q, cos, sin)
            k = _apply_rotary(k, cos, sin)
        context = self.local_attn(q, k, v, *args, **kwargs)
        return _SeqAllToAll.apply(
            group, context, self.gather_idx, self.scatter_idx, batch_dim_idx, None, None, None, False, q_counts
        )


def _apply_rotary(t: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    rotary = cos.shape[-1]
    rotated, rest = t[..., :rotary], t[..., rotary:]
    rotated = rotated * cos + _rotate_half(rotated) * sin
    return torch.cat((rotated, rest), dim=-1) if rest.shape[-1] else rotated
