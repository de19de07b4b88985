"""The exchange buffers of expert and sequence parallelism, from their sizes (not traced: the
trace runs one rank alone, where no all-to-all happens).

* expert exchange (zeroshard/moe/sharded_moe.py, DeepSpeed's MoE layer with ep_size > 1): each
  MoE layer's dispatched tokens, experts x capacity x hidden in the compute dtype, are sent by an
  all-to-all into a buffer of the same size, and the experts' outputs come back the same way; the
  larger of the two exchanges is in flight at once, so a layer adds two dispatched-sized buffers
  at its peak. capacity = max(min_capacity, ceil(k x tokens / experts x capacity_factor)).
* sequence exchange (Ulysses, zeroshard/sequence/): each attention's query, key and value are
  exchanged (sequence-sharded to head-sharded) and its output back: four buffers of micro-batch x
  seq / P x hidden at once.
"""

from __future__ import annotations

import math

from torch import nn

from zeroshard.config.schema import ZeroshardConfig

__all__ = ["exchange_buffer_bytes"]


def _hidden_of(module: nn.Module) -> int | None:
    config = getattr(module, "config", None)
    for name in ("n_embd", "hidden_size", "d_model"):
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    return None


def exchange_buffer_bytes(
    model: nn.Module, config: ZeroshardConfig, micro_batch: int, seq: int | None
) -> dict[str, int]:
    """{"expert_exchange": bytes, "sequence_exchange": bytes} at their peak on one rank."""
    from zeroshard.moe.layer import MoE

    plan = config.precision_plan
    itemsize = (plan.autocast_dtype or next(iter(plan.groups.values())).param_dtype).itemsize
    tokens = micro_batch * (seq or 0)
    expert = 0
    for module in model.modules():
        if isinstance(module, MoE) and module.ep_size > 1 and tokens:
            gate = module.deepspeed_moe.gate
            capacity = max(int(gate.min_capacity),
                           math.ceil(gate.k * tokens / module.num_experts * float(gate.capacity_factor)))
            hidden = gate.wg.weight.shape[1]
            expert = max(expert, 2 * module.num_experts * capacity * hidden * itemsize)
    sp = config.sequence_parallel_size
    hidden = _hidden_of(model)
    sequence = 4 * micro_batch * (seq or 0) // sp * hidden * itemsize if sp > 1 and hidden else 0
    return {"expert_exchange": expert, "sequence_exchange": sequence}
