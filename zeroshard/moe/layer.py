"""DeepSpeed's `MoE` layer (`deepspeed.moe.layer.MoE`): same constructor, forward, return value
and state-dict layout, so a DeepSpeed model ports by changing the import.

    from zeroshard.moe.layer import MoE
    moe = MoE(hidden_size=64, expert=nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)),
              num_experts=8, ep_size=2, k=2)
    output, l_aux, exp_counts = moe(hidden_states)      # add l_aux (times a coefficient) to the loss

`<moe>.deepspeed_moe.gate.wg.weight` is the router (zeroshard/moe/sharded_moe.py),
`<moe>.deepspeed_moe.experts.deepspeed_experts.<j>` local expert j, which is global expert
`ep_rank * num_local_experts + j` with ep_rank = rank % ep_size (zeroshard/sharding/layout.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from zeroshard.comm import collectives as comm
from zeroshard.comm.eager_regions import runs_eagerly
from zeroshard.moe.dispatcher import MOELayer
from zeroshard.moe.experts import Experts
from zeroshard.moe.sharded_moe import NOISY_GATE_POLICIES, TopKGate
from zeroshard.sharding.layout import ParallelLayout, current_layout, expert_group_name


class MoE(nn.Module):
    """A mixture-of-experts layer with expert parallelism.

    Args:
        hidden_size: the input and output dimension.
        expert: the module copied into every local expert (an MLP, a Linear, ...).
        num_experts: experts in the layer, over all expert-parallel ranks.
        ep_size: ranks the experts are spread over (consecutive ranks; must divide the world
            and num_experts).
        k: experts per token (1, 2, or more for top-k gating).
        capacity_factor / eval_capacity_factor: capacity multiplier in training / eval.
        min_capacity: the smallest capacity per expert.
        use_residual: Residual MoE: blend the MoE output with a dense `expert` (`mlp`) by a
            learned softmax coefficient.
        noisy_gate_policy: None, "Jitter" (input noise) or "RSample" (Gumbel noise on top-1).
        drop_tokens: drop routes past the capacity; False: no drops (capacity = largest load).
        use_rts: random token selection for top-1 drops.
        use_tutel / enable_expert_tensor_parallelism: not supported (refused).
        top2_2nd_expert_sampling: Gumbel-sample top-2's second expert.
    """

    def __init__(
        self,
        hidden_size: int,
        expert: nn.Module,
        num_experts: int = 1,
        ep_size: int = 1,
        k: int = 1,
        capacity_factor: float = 1.0,
        eval_capacity_factor: float = 1.0,
        min_capacity: int = 4,
        use_residual: bool = False,
        noisy_gate_policy: str | None = None,
        drop_tokens: bool = True,
        use_rts: bool = True,
        use_tutel: bool = False,
        enable_expert_tensor_parallelism: bool = False,
        top2_2nd_expert_sampling: bool = True,
    ) -> None:
        super().__init__()
        _check_arguments(num_experts, ep_size, k, noisy_gate_policy, use_tutel, enable_expert_tensor_parallelism)
        self.use_residual = use_residual
        self.enable_expert_tensor_parallelism = enable_expert_tensor_parallelism
        self.ep_size = ep_size
        self.expert_group_name = expert_group_name(ep_size)
        self.num_experts = num_experts
        self.num_local_experts = num_experts // ep_size

        experts = Experts(expert, self.num_local_experts, self.expert_group_name)
        gate = TopKGate(
            hidden_size, num_experts, k, capacity_factor, eval_capacity_factor, min_capacity,
            noisy_gate_policy, drop_tokens, use_rts, None, top2_2nd_expert_sampling,
        )
        self.deepspeed_moe = MOELayer(gate, experts, self.expert_group_name, ep_size, self.num_local_experts)
        if use_residual:
            self.mlp = expert
            self.coefficient = nn.Linear(hidden_size, 2)

    def set_deepspeed_parallelism(
        self, use_data_before_expert_parallel_: bool = False, layout: ParallelLayout | None = None
    ) -> None:
        """Attach the expert-parallel group of `layout` (the engine's; else the process's one
        layout, which builds it once per ep_size, collectively)."""
        if use_data_before_expert_parallel_:
            raise ValueError(
                "use_data_before_expert_parallel_=True: not supported by zeroshard (expert-parallel "
                "groups are consecutive ranks). Leave it False."
            )
        ep, _ = (layout if layout is not None else current_layout()).expert_groups(self.ep_size)
        self.deepspeed_moe._set_ep_group(ep)

    @property
    def ep_rank(self) -> int:
        """This rank's index in its expert-parallel group (its experts' block of global ids)."""
        return current_layout().expert_parallel_rank(self.ep_size)

    def global_expert_index(self, local_index: int) -> int:
        return self.ep_rank * self.num_local_experts + local_index

    @runs_eagerly("the MoE layer: gating with capacity and the token all-to-all (comm/eager_regions.py's note)")
    def forward(self, hidden_states: torch.Tensor, used_token: torch.Tensor | None = None):
        """Returns (output shaped like hidden_states, l_aux, exp_counts)."""
        if self.deepspeed_moe.ep_group is None:
            self.set_deepspeed_parallelism()
        output = self.deepspeed_moe(hidden_states, used_token)
        if self.use_residual:
            output_mlp = self.mlp(hidden_states)
            if isinstance(output_mlp, tuple):
                output_mlp = output_mlp[0]
            coef = F.softmax(self.coefficient(hidden_states), dim=-1)
            output = output * coef[..., 0:1] + output_mlp * coef[..., 1:]
        return output, self.deepspeed_moe.l_aux, self.deepspeed_moe.exp_counts


def _check_arguments(num_experts, ep_size, k, noisy_gate_policy, use_tutel, expert_tp) -> None:
    problems = []
    if not isinstance(ep_size, int) or ep_size < 1:
        problems.append(f"ep_size={ep_size}: must be a positive integer.")
    elif num_experts % ep_size:
        problems.append(
            f"num_experts={num_experts}: must be divisible by ep_size ({ep_size}), each expert-parallel "
            "rank holding num_experts / ep_size experts. Change num_experts or ep_size."
        )
    elif comm.world_size() > 1 and comm.world_size() % ep_size:
        problems.append(
            f"ep_size={ep_size}: must divide the world size {comm.world_size()} (world = expert-parallel x "
            "expert-data-parallel ranks). Pick a divisor of the number of ranks."
        )
    if not isinstance(k, int) or not 1 <= k <= num_experts:
        problems.append(f"k={k}: must be between 1 and num_experts ({num_experts}). Lower k or add experts.")
    if noisy_gate_policy not in NOISY_GATE_POLICIES:
        problems.append(f"noisy_gate_policy={noisy_gate_policy!r}: must be None, 'None', 'Jitter' or 'RSample'.")
    if use_tutel:
        problems.append("use_tutel=True: Tutel is not supported by zeroshard. Leave use_tutel=False.")
    if expert_tp:
        problems.append(
            "enable_expert_tensor_parallelism=True: expert tensor parallelism is not supported by zeroshard "
            "(no tensor parallelism). Leave it False."
        )
    if problems:
        raise ValueError("MoE: " + " ".join(problems))
