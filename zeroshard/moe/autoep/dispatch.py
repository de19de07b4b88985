"""Dropless token exchange for AutoEP: counts first, then the tokens, by all-to-all with
uneven splits over the expert-parallel group (every route reaches its expert; nothing is
padded to a capacity).

Sender side: routes sorted by global expert id, so the block for expert-parallel rank r is
the routes to experts r*L .. r*L+L-1 (L local experts), in expert order. Receiver side: blocks
arrive by source rank, each sorted by local expert; `local_order` regroups them by local
expert so each expert runs one matmul over a contiguous slice.
"""

from __future__ import annotations

import torch
from torch import Tensor

from zeroshard.comm import collectives as comm
from zeroshard.comm.collectives import Group
from zeroshard.comm.exchange import all_to_all


def all_to_all_v(x: Tensor, group: Group, send: list[int], recv: list[int], tag: str) -> Tensor:
    """The uneven exchange (zeroshard/comm/exchange.py) under DeepSpeed's AutoEP name."""
    return all_to_all(x, group, send, recv, tag)


class ExchangePlan:
    """Split sizes of one forward's exchange.

    Attributes:
        send / recv: rows sent to / received from each expert-parallel rank.
        local_counts: rows per local expert after regrouping (host ints).
        local_order: permutation of the received rows that groups them by local expert (None
            when they already are: one rank).
    """

    def __init__(self, counts: Tensor, group: Group | None, num_local: int) -> None:
        ep = 1 if group is None else group.size
        by_rank = counts.view(ep, num_local)  # [dest rank, local expert] routes this rank sends
        if ep == 1:
            received = by_rank
        else:
            received = torch.empty_like(by_rank.reshape(-1))
            comm.all_to_all_single(received, by_rank.reshape(-1).contiguous(), group=group, tag="autoep_counts")
            received = received.view(ep, num_local)  # [source rank, local expert]
        # One host read for every split size of this layer's forward.
        host = torch.stack([by_rank.sum(1), received.sum(1)]).tolist() + [received.sum(0).tolist()]
        self.send: list[int] = [int(v) for v in host[0]]
        self.recv: list[int] = [int(v) for v in host[1]]
        self.local_counts: list[int] = [int(v) for v in host[2]]
        self.local_order: Tensor | None = None
        if ep > 1 and num_local > 1:
            expert_of_row = torch.repeat_interleave(
                torch.arange(num_local, device=counts.device).repeat(ep), received.reshape(-1)
            )
            self.local_order = torch.argsort(expert_of_row, stable=True)


def dispatch(tokens: Tensor, selected: Tensor, num_experts: int, group: Group | None, num_local: int):
    """Send each route's token to the rank holding its expert.

    Returns (expert inputs grouped by local expert, plan, route order): route order is the
    permutation of the flat [T*k] routes the exchange used, for `combine`.
    """
    flat = selected.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    plan = ExchangePlan(counts, group, num_local)
    k = selected.shape[-1]
    routed = tokens.index_select(0, order // k)
    if group is not None:
        routed = all_to_all_v(routed, group, plan.send, plan.recv, "autoep_dispatch")
    if plan.local_order is not None:
        routed = routed.index_select(0, plan.local_order)
    return routed, plan, order


def combine(expert_out: Tensor, plan: ExchangePlan, order: Tensor, group: Group | None, num_routes: int) -> Tensor:
    """The inverse of `dispatch`: each route's expert output back in [T*k] route order."""
    if plan.local_order is not None:
        expert_out = torch.empty_like(expert_out).index_copy(0, plan.local_order, expert_out)
    if group is not None:
        expert_out = all_to_all_v(expert_out, group, plan.recv, plan.send, "autoep_combine")
    out = expert_out.new_empty((num_routes, expert_out.shape[-1]))
    return out.index_copy(0, order, expert_out)
