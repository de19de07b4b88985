"""The token dispatcher of an MoE layer: place each kept route in its expert's capacity slot,
exchange the slots over the expert-parallel group by all-to-all (with gradients:
zeroshard/comm/exchange.py), run the
local experts, send the results back and combine each token's routes by their gate weights.

Layout of the exchanged buffer: [experts E, capacity C, d_model M] with E = ep_size x
num_local_experts, expert-major, so the i-th of ep_size equal slices holds the slots of the
experts on expert-parallel rank i (global expert `ep_rank * num_local_experts + j`). Every rank
of the group exchanges the same number of elements: the router agrees the capacity by a MAX
all-reduce before any slot is filled (zeroshard/moe/sharded_moe.py), so ranks holding
different numbers of tokens (a smaller last batch, dynamic padding) exchange equal buffers,
and a rank whose experts got no tokens still takes part with zero-filled slots.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from zeroshard.comm.collectives import Group
from zeroshard.comm.exchange import all_to_all


def route_slots(indices: Tensor, locations: Tensor, num_experts: int, capacity: int) -> Tensor:
    """Each route's flat slot in the [E * C] buffer; dropped routes (index -1) go to one extra
    scratch slot E * C, which encode fills with zeros and decode never reads as output."""
    slot = indices.long() * capacity + locations.long()
    return torch.where(indices >= 0, slot, torch.full_like(slot, num_experts * capacity))


def encode(tokens: Tensor, slots: Tensor, num_experts: int, capacity: int) -> Tensor:
    """tokens [S, M] -> [E, C, M], each kept route's token in its slot, zeros elsewhere.

    A gather through the inverse map (slot -> token; empty slots read a zero row): the
    gradient then sums a token's routes back onto it."""
    num_tokens, d_model = tokens.shape
    source = torch.full((num_experts * capacity + 1,), num_tokens, dtype=torch.long, device=tokens.device)
    token_ids = torch.arange(num_tokens, device=tokens.device).expand_as(slots)
    source.scatter_(0, slots.reshape(-1), token_ids.reshape(-1))
    padded = torch.cat([tokens, tokens.new_zeros(1, d_model)])
    return padded.index_select(0, source[:-1]).view(num_experts, capacity, d_model)


def decode(expert_output: Tensor, slots: Tensor, gates: Tensor) -> Tensor:
    """expert_output [E * C, M] -> [S, M]: per token the gate-weighted sum of its routes'
    outputs (a dropped route reads the zero scratch row). Summed in fp32 (the gates' dtype),
    then cast back."""
    d_model = expert_output.shape[-1]
    padded = torch.cat([expert_output, expert_output.new_zeros(1, d_model)])
    k, num_tokens = slots.shape
    routed = padded.index_select(0, slots.reshape(-1)).view(k, num_tokens, d_model)
    return (routed * gates.unsqueeze(-1)).sum(dim=0).to(expert_output.dtype)


class MOELayer(nn.Module):
    """Router + dispatcher + experts (DeepSpeed's `MOELayer`, the `deepspeed_moe` submodule).

    After a forward, `l_aux` and `exp_counts` hold the router's auxiliary loss and per-expert
    route counts.
    """

    def __init__(self, gate: nn.Module, experts: nn.Module, ep_group_name: str, ep_size: int,
                 num_local_experts: int, use_tutel: bool = False) -> None:
        super().__init__()
        if use_tutel:
            raise ValueError("use_tutel=True: Tutel is not supported by zeroshard. Leave use_tutel=False.")
        self.gate = gate
        self.experts = experts
        self.ep_group: Group | None = None
        self.ep_size = ep_size
        self.ep_group_name = ep_group_name
        self.num_local_experts = num_local_experts
        self.l_aux: Tensor | None = None
        self.exp_counts: Tensor | None = None

    def _set_ep_group(self, ep_group: Group) -> None:
        self.ep_group = ep_group
        self.gate._set_ep_group(ep_group)

    def forward(self, *input: Tensor, **kwargs: Any) -> Tensor:
        hidden = input[0]
        used_token = input[1] if len(input) > 1 else None
        d_model = hidden.shape[-1]
        tokens = hidden.reshape(-1, d_model)
        if self.ep_size > 1 and self.ep_group is None:
            raise RuntimeError(
                f"MOELayer with ep_size={self.ep_size} has no expert-parallel group: call "
                "MoE.set_deepspeed_parallelism() (zeroshard.initialize does) before the forward."
            )

        self.l_aux, capacity, num_experts, indices, locations, gates, self.exp_counts = self.gate(
            tokens, used_token, True
        )
        capacity = int(capacity)  # one host read; the buffers are sized by it
        slots = route_slots(indices, locations, num_experts, capacity)
        dispatched = encode(tokens, slots, num_experts, capacity)
        group = self.ep_group
        if group is not None:
            dispatched = all_to_all(dispatched, group, tag="moe_dispatch")
        # [ep_size (source rank), num_local_experts, C, M] after the exchange
        expert_output = self.experts(dispatched.reshape(self.ep_size, self.num_local_experts, capacity, d_model))
        expert_output = expert_output.reshape(num_experts, capacity, d_model)
        if group is not None:
            expert_output = all_to_all(expert_output, group, tag="moe_combine")
        combined = decode(expert_output.reshape(num_experts * capacity, d_model), slots, gates)
        return combined.reshape(hidden.shape)
