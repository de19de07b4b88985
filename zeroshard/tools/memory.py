"""Per-rank memory estimate of zeroshard's mechanism (docs/design.md sections 3 and 7).

What each stage keeps on a rank, for P parameters in a group on W ranks, with the group's flat
buffers padded to a multiple of W (a shard is ``ceil(P / W)`` elements):

==============  ==================  ==================  ==========================  =============
stage           parameters          gradients kept      master weights              optim. state
==============  ==================  ==================  ==========================  =============
0               P (param dtype)     P (accum dtype)     P (none if master = param)  P
1               P                   P                   shard                       shard
2               P                   shard               shard                       shard
3               shard (see below)   shard               shard                       shard
==============  ==================  ==================  ==========================  =============

Those are the *model states*. For the default mixed-precision Adam case with 16-bit
accumulation they are the ZeRO paper's numbers (stage 1: 4P + 12P/W bytes; stage 2:
2P + 14P/W; stage 3: 16P/W); zeroshard's fp32 accumulation default adds 2 bytes per
accumulated element. In fp32 and torch_autocast modes the master weights are the parameters.
At stage 3 with a master wider than the parameters on the device (bf16 or fp16 with fp32
masters, no offload) no parameter shard is kept either: each gather casts the master
(zeroshard/sharding/flat.py's [Note: gathering from the master]), so the parameters count 0
between uses and bf16 Adam's stage 3 holds 14P/W bytes with 16-bit accumulation.

*Buffers* come on top, each bounded by a bucket size or a unit, never by the model:

* stages 2-3: a transient local gradient buffer for the unit being reduced (largest unit,
  accumulation dtype), freed once it is copied into the reduce bucket;
* all stages: the reduce buckets (``reduce_bucket_size`` elements each, reduce dtype; one
  being filled per wire dtype and one being reduced, zeroshard/grads/reduce.py). They fill
  across units, so only the model's size bounds them below that;
* stages 1-2: the parameter all-gather after the step (``allgather_bucket_size``, gather dtype);
* stage 3: gathered units (prefetch bucket + the largest unit, gather dtype) and the small units
  kept resident (below ``stage3_param_persistence_threshold``);
* torch_autocast, every stage: autocast's copies of the lower_precision_safe parameters in the
  autocast dtype. A matmul under autocast casts its fp32 weight and saves the cast copy for its
  backward, so every unit's copy lives from its forward to its backward, on every rank: at
  stage 3 this does *not* shrink as 1/W (the gathered fp32 flat is freed after the unit's
  forward, its bf16 copy is not). Counted as the whole safe group (an upper bound: a bias is
  cast but not saved).

With ZeRO-Offload (zeroshard/sharding/offload.py) each role has a placement: ``offload_optimizer`` puts
the master weights (always a copy of their own there, also when the plan says the masters are
the parameters, except at stage 3 with ``offload_param`` where the host parameter shard is the
fp32 master) and the optimizer state on the host, ``offload_param`` stage 3's parameter
shard. The host also holds one gradient landing buffer per flat (the shard in the master
dtype, pinned with ``pin_memory`` and a GPU). ``device_bytes`` and ``host_bytes`` split the
total by where it lives.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from zeroshard.config.optimizers import optimizer_kind
from zeroshard.config.schema import ZeroshardConfig
from zeroshard.precision.plan import GROUP_SAFE, PrecisionPlan
from zeroshard.sharding.flat import master_feeds_gather
from zeroshard.sharding.stages import StagePolicy, stage_policy

__all__ = [
    "MemoryEstimate",
    "bytes_per_param",
    "estimate_for_config",
    "estimate_memory",
    "optimizer_state_count",
    "padded_shard_numel",
    "zero_paper_model_state_bytes",
]

MODEL_STATE_KEYS = ("params", "gradients", "master_weights", "optimizer_state")
BUFFER_KEYS = (
    "grad_unit_buffer", "reduce_bucket", "allgather_bucket", "gathered_units", "resident_units",
    "autocast_weight_copies",
)


def _size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def padded_shard_numel(numel: int, world_size: int) -> int:
    """Elements of one rank's shard: the flat buffer is padded up to a multiple of W."""
    return math.ceil(numel / world_size)


def optimizer_state_count(optimizer_type: str | None, params: Mapping[str, object] | None = None) -> int:
    """Tensors of optimizer state per parameter element.

    Adam/AdamW keep 2 (exp_avg, exp_avg_sq); SGD keeps 1 with momentum and 0 without; Muon
    keeps 1 (momentum). None (the user brings an optimizer) is counted as AdamW.
    """
    kind = optimizer_kind(optimizer_type or "AdamW")
    if kind is not None:
        return kind.state_tensors(params or {})
    raise ValueError(f"optimizer type {optimizer_type!r}: unknown to the memory estimator")


def zero_paper_model_state_bytes(stage: int, num_params: int, world_size: int, k: int = 12) -> float:
    """The ZeRO paper's per-rank model-state bytes for mixed precision (2-byte params/grads).

    ``k`` is the optimizer's bytes per parameter (12 for Adam: fp32 master + two fp32 moments).
    """
    p, w = num_params, world_size
    return {0: (4 + k) * p, 1: 4 * p + k * p / w, 2: 2 * p + (2 + k) * p / w, 3: (4 + k) * p / w}[stage]


def _sharded_roles(policy: StagePolicy, param: int, grad: int, master: int, state: int) -> list[tuple[int, bool]]:
    """Each model state with whether the stage keeps only a shard of it (the StagePolicy's
    answer: stages.py is the one place a stage is described)."""
    return [
        (param, not policy.keep_full_params),
        (grad, policy.reduce_every_backward),
        (master, policy.shard_optimizer),
        (state, policy.shard_optimizer),
    ]


def bytes_per_param(
    plan: PrecisionPlan, stage: int, state_count: int = 2, group: str | None = None, offloaded: bool = False
) -> tuple[int, int]:
    """Model-state bytes per parameter as ``(a, b)``, meaning ``a * P + b * P / W``.

    Args:
        plan: the precision plan.
        stage: ZeRO stage 0-3.
        state_count: optimizer state tensors per element (see ``optimizer_state_count``).
        group: the plan's group to use (default: the first).
        offloaded: ZeRO-Offload (optimizer or parameters) is on: stage 3 then keeps its
            parameter shard (see ``master_feeds_gather``).
    """
    role = plan.groups[group or next(iter(plan.groups))]
    policy = stage_policy(stage)
    param, grad = _size(role.param_dtype), _size(role.grad_accum_dtype)
    if not policy.keep_full_params and master_feeds_gather(role, offloaded):
        param = 0  # stage 3 gathers cast the master: no parameter shard is kept
    master = 0 if role.master_is_param else _size(role.master_dtype)
    state = state_count * _size(role.optimizer_state_dtype)
    replicated = sharded = 0
    for nbytes, is_sharded in _sharded_roles(policy, param, grad, master, state):
        if is_sharded:
            sharded += nbytes
        else:
            replicated += nbytes
    return replicated, sharded


@dataclass(frozen=True)
class MemoryEstimate:
    """Estimated bytes on one rank.

    Attributes:
        stage, world_size: what was estimated.
        num_params: parameter elements, all groups.
        per_group: for each precision group: its element count, padded count and model states.
        model_states: bytes by role (params, gradients, master_weights, optimizer_state).
        buffers: bytes of bounded transient/communication buffers.
        assumptions: what the estimate assumed (printed by explain).
        placement: where each model-state role lives ("device" or "host").
        host_buffers: bytes of host buffers (offload's gradient landing buffers).
        pinned: whether the host buffers and states are pinned (pin_memory).
    """

    stage: int
    world_size: int
    num_params: int
    per_group: dict[str, dict[str, int]]
    model_states: dict[str, int]
    buffers: dict[str, int]
    assumptions: list[str] = field(default_factory=list)
    placement: dict[str, str] = field(default_factory=lambda: dict.fromkeys(MODEL_STATE_KEYS, "device"))
    host_buffers: dict[str, int] = field(default_factory=dict)
    pinned: bool = False

    @property
    def device_bytes(self) -> int:
        """What lives on the accelerator: device-placed model states and every device buffer."""
        states = sum(v for k, v in self.model_states.items() if self.placement[k] == "device")
        return states + self.buffer_bytes

    @property
    def host_bytes(self) -> int:
        """What lives in host memory: offloaded model states and the host buffers."""
        states = sum(v for k, v in self.model_states.items() if self.placement[k] == "host")
        return states + sum(self.host_buffers.values())

    @property
    def model_state_bytes(self) -> int:
        return sum(self.model_states.values())

    @property
    def buffer_bytes(self) -> int:
        return sum(self.buffers.values())

    @property
    def total_bytes(self) -> int:
        return self.model_state_bytes + self.buffer_bytes

    def as_dict(self) -> dict[str, object]:
        return {
            "stage": self.stage,
            "world_size": self.world_size,
            "num_params": self.num_params,
            "per_group": self.per_group,
            "model_states": self.model_states,
            "buffers": self.buffers,
            "model_state_bytes": self.model_state_bytes,
            "buffer_bytes": self.buffer_bytes,
            "total_bytes": self.total_bytes,
            "assumptions": list(self.assumptions),
            "placement": dict(self.placement),
            "host_buffers": dict(self.host_buffers),
            "pinned": self.pinned,
            "device_bytes": self.device_bytes,
            "host_bytes": self.host_bytes,
        }


def estimate_memory(
    plan: PrecisionPlan,
    stage: int,
    world_size: int,
    param_counts: int | Mapping[str, int],
    *,
    optimizer_states: int = 2,
    reduce_bucket_size: int = 500_000_000,
    allgather_bucket_size: int = 500_000_000,
    prefetch_bucket_size: int = 50_000_000,
    unit_numels: list[int] | None = None,
    persistence_threshold: int = 100_000,
    expert_counts: Mapping[int, Mapping[str, int]] | None = None,
    offload_optimizer: bool = False,
    offload_param: bool = False,
    pin_memory: bool = False,
) -> MemoryEstimate:
    """Estimate per-rank bytes for ``stage`` on ``world_size`` ranks.

    Args:
        plan: the precision plan (dtypes per group).
        stage: ZeRO stage 0-3.
        world_size: data-parallel ranks W.
        param_counts: parameter elements, per group name of ``plan`` or one int (then all in
            the plan's first group; in torch_autocast mode that is "lower_precision_safe", the
            one with the larger wire dtype makes no difference to model states).
        optimizer_states: state tensors per element (``optimizer_state_count``).
        reduce_bucket_size, allgather_bucket_size, prefetch_bucket_size: bucket sizes in
            elements (``zero_optimization``).
        unit_numels: element counts of the units (docs/design.md section 3); None = one unit holding
            everything (an upper bound).
        persistence_threshold: stage-3 units smaller than this stay gathered.
        expert_counts: MoE expert parameters held on a rank (its local experts), by the
            expert-data-parallel size they are sharded over, then by precision group; not
            included in ``param_counts`` (docs/design.md section 9: experts are sharded over EDP).
        offload_optimizer, offload_param, pin_memory: ZeRO-Offload (see the module docstring).
    """
    policy = stage_policy(stage)  # ValueError naming the stage for anything but 0-3
    if world_size < 1:
        raise ValueError(f"world_size={world_size}: must be positive")
    counts = {next(iter(plan.groups)): param_counts} if isinstance(param_counts, int) else dict(param_counts)
    unknown = set(counts) - set(plan.groups)
    if unknown:
        raise ValueError(
            f"param_counts names groups {sorted(unknown)} that the plan does not have ({list(plan.groups)})"
        )
    # (precision group, elements on this rank unsharded, ranks they are sharded over)
    holdings = [(name, numel, world_size) for name, numel in counts.items()]
    for edp_size, by_group in (expert_counts or {}).items():
        unknown |= set(by_group) - set(plan.groups)
        holdings += [(name, numel, edp_size) for name, numel in by_group.items()]
    if unknown:
        raise ValueError(f"expert_counts names groups {sorted(unknown)} that the plan does not have")
    total = sum(numel for _, numel, _ in holdings)
    units = list(unit_numels) if unit_numels else [total]
    largest_unit = max(units) if units else 0
    assumptions = []
    if not unit_numels:
        assumptions.append("one unit holding every parameter (pass a model for its real units)")

    model_states = dict.fromkeys(MODEL_STATE_KEYS, 0)
    placement = dict.fromkeys(MODEL_STATE_KEYS, "device")
    offload_param = offload_param and not policy.keep_full_params
    if offload_optimizer:
        placement["master_weights"] = placement["optimizer_state"] = "host"
    if offload_param:
        placement["params"] = "host"
    host_buffers: dict[str, int] = {}
    per_group: dict[str, dict[str, int]] = {}
    for name, numel, shard_size in holdings:
        role = plan.groups[name]
        shard = padded_shard_numel(numel, shard_size)
        # An offloaded master is a copy of its own, unless the host parameter shard is it.
        master_is_param = role.master_is_param and offload_optimizer == offload_param
        kept = {  # elements of each role held on this rank
            "params": numel if policy.keep_full_params else (
                0 if master_feeds_gather(role, offload_optimizer or offload_param) else shard
            ),
            "gradients": shard if policy.reduce_every_backward else numel,
            "master_weights": 0 if master_is_param else (shard if policy.shard_optimizer else numel),
            "optimizer_state": optimizer_states * (shard if policy.shard_optimizer else numel),
        }
        group_bytes = {
            "params": kept["params"] * _size(role.param_dtype),
            "gradients": kept["gradients"] * _size(role.grad_accum_dtype),
            "master_weights": kept["master_weights"] * _size(role.master_dtype),
            "optimizer_state": kept["optimizer_state"] * _size(role.optimizer_state_dtype),
        }
        for key, value in group_bytes.items():
            model_states[key] += value
        label = name if shard_size == world_size and name not in per_group else f"{name} (experts, EDP {shard_size})"
        per_group[label] = {"num_params": numel, "padded_num_params": shard * shard_size, **group_bytes}
        if offload_optimizer:  # the reduced shard lands here before the host step
            host_buffers["grad_landing"] = host_buffers.get("grad_landing", 0) + shard * _size(role.master_dtype)

    # Buffers take the widest dtype of any group present: they are bounds, not exact figures.
    roles = [plan.groups[name] for name, n, _ in holdings if n > 0] or [next(iter(plan.groups.values()))]
    accum_size = max(_size(r.grad_accum_dtype) for r in roles)
    reduce_size = max(_size(r.reduce_dtype) for r in roles)
    gather_size = max(_size(r.gather_dtype) for r in roles)
    buffers = dict.fromkeys(BUFFER_KEYS, 0)
    # One bucket filling per (accumulation, wire) dtype pair, plus one being reduced.
    filling = len({(r.grad_accum_dtype, r.reduce_dtype) for r in roles})
    buffers["reduce_bucket"] = min((filling + 1) * reduce_bucket_size, total) * reduce_size
    if policy.reduce_every_backward:
        buffers["grad_unit_buffer"] = largest_unit * accum_size
    if policy.shard_optimizer and policy.keep_full_params:  # masters published after the step
        buffers["allgather_bucket"] = min(allgather_bucket_size, total) * gather_size
    if not policy.keep_full_params:
        resident = sum(n for n in units if n < persistence_threshold)
        buffers["resident_units"] = resident * gather_size
        buffers["gathered_units"] = min(prefetch_bucket_size + largest_unit, total - resident) * gather_size
    if plan.autocast_dtype is not None:  # see the module docstring: W-independent at every stage
        buffers["autocast_weight_copies"] = sum(
            numel * _size(plan.autocast_dtype)
            for name, numel in counts.items()
            if name == GROUP_SAFE and plan.groups[name].param_dtype != plan.autocast_dtype
        )
    return MemoryEstimate(
        stage=stage,
        world_size=world_size,
        num_params=total,
        per_group=per_group,
        model_states=model_states,
        buffers=buffers,
        assumptions=assumptions,
        placement=placement,
        host_buffers=host_buffers,
        pinned=pin_memory and (offload_optimizer or offload_param),
    )


def estimate_for_config(
    config: ZeroshardConfig,
    plan: PrecisionPlan,
    param_counts: int | Mapping[str, int],
    *,
    world_size: int | None = None,
    unit_numels: list[int] | None = None,
    expert_counts: Mapping[int, Mapping[str, int]] | None = None,
) -> MemoryEstimate:
    """``estimate_memory`` with the stage, bucket sizes and optimizer taken from ``config``."""
    zero = config.zero_optimization
    optimizer = config.optimizer
    estimate = estimate_memory(
        plan,
        zero.stage,
        world_size or config.world_size,
        param_counts,
        optimizer_states=optimizer_state_count(optimizer.type if optimizer else None,
                                               optimizer.params if optimizer else None),
        reduce_bucket_size=zero.reduce_bucket_size,
        allgather_bucket_size=zero.allgather_bucket_size,
        prefetch_bucket_size=zero.stage3_prefetch_bucket_size,
        unit_numels=unit_numels,
        persistence_threshold=zero.stage3_param_persistence_threshold,
        expert_counts=expert_counts,
        offload_optimizer=zero.optimizer_offload,
        offload_param=zero.param_offload,
        pin_memory=zero.offload_pin_memory,
    )
    if optimizer is None:
        estimate.assumptions.append("no optimizer in the config: counted as AdamW (2 states)")
    return estimate
