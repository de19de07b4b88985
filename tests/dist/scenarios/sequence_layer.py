"""Rank-side scenarios for tests/dist/sequence/test_sequence_layer.py (Ulysses all-to-all and attention).

Every rank builds the same full tensors from a seed, takes its own sequence chunk, and runs the
distributed computation; the single-process result on the full tensors is computed on every
rank too, so each rank returns its own chunk of both and the test compares them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from zeroshard.comm import collectives as comm
from zeroshard.sequence.layer import DistributedAttention, _SeqAllToAll, head_counts
from zeroshard.sharding.layout import partition


@dataclass(frozen=True)
class AttentionCase:
    """One DistributedAttention scenario.

    Attributes:
        heads, kv_heads: query and key/value head counts.
        batch_dim_idx: 0 for [batch, seq, heads, dim], 1 for [seq, batch, heads, dim].
        sp: sequence-parallel size (the world, or consecutive groups of `sp` ranks).
        torch_group: pass a torch ProcessGroup instead of a zeroshard Group.
        rotary: apply rotary embeddings through `rotary_pos_emb`.
        sp_stream: pass a stream-like object as `sp_stream` (CPU tensors: it must be ignored,
            touching it raises).
    """

    heads: int
    kv_heads: int
    batch_dim_idx: int = 0
    sp: int | None = None
    torch_group: bool = False
    rotary: bool = False
    sp_stream: bool = False
    batch: int = 2
    seq_per_rank: int = 3
    head_size: int = 8

    @property
    def label(self) -> str:
        return (
            f"H={self.heads} KV={self.kv_heads} batch_dim={self.batch_dim_idx} sp={self.sp} "
            f"torch_group={self.torch_group} rotary={self.rotary} sp_stream={self.sp_stream}"
        )


class _UntouchableStream:
    """Stands in for a CUDA stream on CPU: DistributedAttention must not use it there."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"sp_stream.{name} used with CPU tensors")


def _sequence_group(sp: int | None) -> comm.Group:
    world = comm.world_group()
    if sp is None or sp == world.size:
        return world
    consecutive, _ = partition(world, sp)
    return consecutive


def _layout(t: torch.Tensor, batch_dim_idx: int) -> torch.Tensor:
    """[batch, seq, ...] -> the case's layout (a view)."""
    return t if batch_dim_idx == 0 else t.transpose(0, 1)


def round_trip(cases: list[tuple[int, int, int | None]]) -> list[dict[str, Any]]:
    """For (heads, batch_dim_idx, sp): scatter heads / gather sequence, then back.

    Returns per case: this rank's input, the gathered tensor, the expected gathered tensor
    (the full sequence for this rank's heads, cut from every rank's input rebuilt here from
    their seeds), and the tensor after the inverse exchange.
    """
    results = []
    for heads, batch_dim_idx, sp in cases:
        group = _sequence_group(sp)
        p, r = group.size, group.rank
        # Rank j of the group holds chunk j of one [2, 4 * p, heads, 5] tensor of distinct values.
        full = torch.arange(2 * 4 * p * heads * 5, dtype=torch.float32).view(2, 4 * p, heads, 5)
        full = full + 1000.0 * group.ranks[0]  # different groups hold different data
        mine = _layout(full[:, 4 * r : 4 * (r + 1)], batch_dim_idx).contiguous()
        counts = head_counts(heads, p)
        first = sum(counts[:r])
        gathered = _SeqAllToAll.apply(group.handle if sp is None else group, mine, 2, 0, batch_dim_idx,
                                      None, None, None, True, counts)
        back = _SeqAllToAll.apply(group, gathered, 0, 2, batch_dim_idx, None, None, None, False, counts)
        expected = _layout(full[:, :, first : first + counts[r]], batch_dim_idx)
        results.append({"input": mine, "gathered": gathered, "expected": expected, "back": back})
    return results


def _sdpa(batch_dim_idx: int):
    """Causal SDPA on [batch, seq, heads, dim] (or [seq, batch, ...]) inputs, GQA allowed."""

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        def to_bhsd(t: torch.Tensor) -> torch.Tensor:
            return _layout(t, batch_dim_idx).transpose(1, 2)

        out = F.scaled_dot_product_attention(to_bhsd(q), to_bhsd(k), to_bhsd(v), is_causal=True, enable_gqa=True)
        return _layout(out.transpose(1, 2), batch_dim_idx)

    return attend


def _rotary(batch: int, seq: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    angles = torch.outer(torch.arange(seq, dtype=torch.float32), inv)
    emb = torch.cat((angles, angles), dim=-1)[None, :, None, :]  # [1, seq, 1, dim]
    return emb.cos().expand(batch, -1, -1, -1), emb.sin().expand(batch, -1, -1, -1)


def _apply_rotary_reference(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = t.shape[-1] // 2
    rotated = torch.cat((-t[..., half:], t[..., :half]), dim=-1)
    return t * cos + rotated * sin


def attention(cases: list[AttentionCase]) -> list[dict[str, Any]]:
    """For each case: this rank's output chunk and q/k/v gradient chunks under
    DistributedAttention, and the same chunks of single-process causal attention."""
    results = []
    for case in cases:
        group = _sequence_group(case.sp)
        p, r = group.size, group.rank
        seq = case.seq_per_rank * p
        gen = torch.Generator().manual_seed(1234 + group.ranks[0])
        shape_q = (case.batch, seq, case.heads, case.head_size)
        shape_kv = (case.batch, seq, case.kv_heads, case.head_size)
        q = torch.randn(shape_q, generator=gen)
        k = torch.randn(shape_kv, generator=gen)
        v = torch.randn(shape_kv, generator=gen)
        grad_out = torch.randn(shape_q, generator=gen)
        cos, sin = _rotary(case.batch, seq, case.head_size)

        # Single process, full sequence: [batch, seq, heads, dim] throughout.
        ref_in = [t.clone().requires_grad_(True) for t in (q, k, v)]
        rq, rk = ref_in[0], ref_in[1]
        if case.rotary:
            rq, rk = _apply_rotary_reference(rq, cos, sin), _apply_rotary_reference(rk, cos, sin)
        ref_out = _sdpa(0)(rq, rk, ref_in[2])
        ref_out.backward(grad_out)

        # Sequence parallel: this rank's chunk, in the case's layout.
        span = slice(case.seq_per_rank * r, case.seq_per_rank * (r + 1))
        local = [_layout(t[:, span], case.batch_dim_idx).clone().requires_grad_(True) for t in (q, k, v)]
        spg = group.handle if case.torch_group else group
        stream = _UntouchableStream() if case.sp_stream else None
        attn = DistributedAttention(_sdpa(case.batch_dim_idx), spg, sp_stream=stream, num_kv_heads=case.kv_heads)
        rotary = (cos, sin) if case.rotary else None
        out = attn(*local, case.batch_dim_idx, rotary)
        out.backward(_layout(grad_out[:, span], case.batch_dim_idx))
        results.append({
            "out": _layout(out.detach(), case.batch_dim_idx),
            "ref_out": ref_out.detach()[:, span],
            "grads": [_layout(t.grad, case.batch_dim_idx) for t in local],
            "ref_grads": [t.grad[:, span] for t in ref_in],
        })
    return results


def refusals() -> list[str]:
    """The errors DistributedAttention raises for inputs it cannot split."""
    group = comm.world_group()
    messages = []
    x = torch.zeros(1, 2, group.size - 1 or 1, 4)
    attn = DistributedAttention(_sdpa(0), group)
    for call in (
        lambda: attn(x, x, x, 0),
        lambda: DistributedAttention(_sdpa(0), group, num_kv_heads=3)(x, x, x, 0),
        lambda: attn(torch.zeros(1, 2, 4, 4), torch.zeros(1, 2, 4, 4), torch.zeros(1, 2, 4, 4), 2),
    ):
        try:
            call()
            messages.append("no error")
        except ValueError as error:
            messages.append(str(error))
    dist.barrier()  # no rank may leave while another is still inside a collective
    return messages


def deepspeed_exchange() -> dict[str, Any]:
    """DeepSpeed 0.19.8's low-level exchange with head counts the group does not divide, on 2
    ranks: `_SeqAllToAll.apply` with its 10th argument `num_kv_heads` (absent, or the key/value
    count a query tensor's split follows), `single_all_to_all` and `uneven_heads_all2all`; each
    scatter, then the gather back from the uneven local heads. And the heads DistributedAttention's
    local attention sees for 6 query over 3 key/value heads."""
    from zeroshard.sequence.layer import single_all_to_all, uneven_heads_all2all

    group = comm.world_group()
    p, r = group.size, group.rank
    out: dict[str, Any] = {}
    for label, heads, kv in (("3 heads", 3, None), ("7 heads", 7, None), ("6 over kv 3", 6, 3)):
        full = torch.arange(2 * 4 * p * heads * 5, dtype=torch.float32).view(2, 4 * p, heads, 5).requires_grad_(True)
        mine = full[:, 4 * r : 4 * (r + 1)]
        gathered = _SeqAllToAll.apply(group, mine, 2, 0, 0, None, None, None, True, kv)
        back = _SeqAllToAll.apply(group, gathered, 0, 2, 0, None, None, None, False, kv)
        via_single = single_all_to_all(mine, 2, 0, 0, group, num_kv_heads=kv if kv else heads)
        via_uneven = uneven_heads_all2all(mine, 2, 0, 0, group, kv if kv else heads)
        back.sum().backward()  # the exchange is differentiable: every element's gradient is 1
        out[label] = {"gathered": gathered.detach(), "full": full.detach(), "back_is_input": torch.equal(back, mine),
                      "single": torch.equal(via_single, gathered), "uneven": torch.equal(via_uneven, gathered),
                      "grad_ones": torch.equal(full.grad[:, 4 * r : 4 * (r + 1)], torch.ones_like(mine))}
    seen = []

    def recording(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        seen.append((q.shape[2], k.shape[2]))
        return _sdpa(0)(q, k, v)

    x, kv_x = torch.randn(1, 4, 6, 8), torch.randn(1, 4, 3, 8)
    DistributedAttention(recording, group)(x, kv_x, kv_x, 0)
    out["attention_heads"] = seen[0]
    return out
