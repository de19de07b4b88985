"""Mixture of Experts with expert parallelism (DeepSpeed's `deepspeed.moe`).

Structure (the router / experts / dispatcher split of torchtitan):
    sharded_moe.py  the router: DeepSpeed's gating functions and TopKGate
    experts.py      the local experts (deep copies of the user's expert)
    dispatcher.py   capacity slots, all-to-all over the expert-parallel group, MOELayer
    layer.py        MoE, DeepSpeed's user-facing layer
    utils.py        expert-parameter helpers and optimizer group splitting
The groups live in zeroshard/groups/__init__.py.
"""

from zeroshard.moe.layer import MoE

__all__ = ["MoE"]
