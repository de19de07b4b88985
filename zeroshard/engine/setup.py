"""Engine setup: from the user's model and arguments to the parts the engine composes.

Each function builds one part; `Engine.__init__` (engine.py) calls them in the order that
bounds start-up memory (tests/unit/engine/test_startup_order.py):

1. `transform_model`: AutoEP swaps Hugging Face MoE blocks for expert-parallel layers, MoE
   layers get their expert groups, and the optimizer groups are split by MoE and Muon.
2. `cast_module`: every parameter gets its precision group's dtype (before anything moves).
3. `build_units`: the config's leaf modules, then units and their flat buffers, one unit at
   a time (stage 3 keeps only shards).
4. `build_optimizer`, `build_scheduler`: on the flats' masters.
5. `build_gradient_path`: the reducer, the `param.grad` views, stage 3's schedule and the
   path that owns the hooks, built together.
6. `build_dataloader`: DeepSpeed's `training_data`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from zeroshard.comm import collectives as comm
from zeroshard.config.schema import ZeroshardConfig
from zeroshard.grads.accumulation import Accumulation
from zeroshard.grads.buffers import FlatGradients
from zeroshard.grads.path import GradientPath
from zeroshard.grads.reduce import GradientReducer, default_bucket_numel
from zeroshard.grads.tree_reduce import TreeReducer
from zeroshard.grads.views import GradViews
from zeroshard.moe.utils import (
    attach_expert_groups,
    is_moe_param,
    split_params_into_different_moe_groups_for_optimizer,
)
from zeroshard.optim import build_optimizer as build_named_optimizer
from zeroshard.optim import repoint_optimizer
from zeroshard.optim.build import build_host_optimizer
from zeroshard.optim.muon import optimizer as muon
from zeroshard.optim.untested import check_client_optimizer
from zeroshard.precision.loss_scale import LossScaler
from zeroshard.precision.plan import PrecisionPlan, assign_param_groups
from zeroshard.sharding.flat import FlatParamGroup
from zeroshard.sharding.layout import ParallelLayout, ShardingSpec
from zeroshard.sharding.schedule import ParamSchedule
from zeroshard.sharding.stages import StagePolicy
from zeroshard.sharding.streams import StreamSet
from zeroshard.sharding.unit import Unit
from zeroshard.sharding.units import full_numel, plan_units
from zeroshard.zero import partition as init_partition
from zeroshard.zero.leaf_modules import apply_leaf_module_config


@dataclasses.dataclass
class ModelTransforms:
    """What `transform_model` leaves: the optimizer groups' hyper-parameters (without
    "params"), each trainable parameter's group index, and the MoE parts the engine keeps."""

    hyper: list[dict[str, Any]]
    group_of: dict[int, int]
    expert_group_names: list[str]
    autoep_settings: Any = None
    load_balancer: Any = None
    autotp: Any = None  # zeroshard.autotp.transform.AutoTPResult with tensor parallelism


def optimizer_groups(
    model: nn.Module, model_parameters: Any, optimizer: Any
) -> tuple[list[dict[str, Any]], dict[int, int]]:
    """The optimizer's parameter groups (hyper-parameters without "params") and, for every
    trainable parameter, the index of its group."""
    if isinstance(optimizer, torch.optim.Optimizer):
        raw_groups = optimizer.param_groups
    elif model_parameters is None:
        raw_groups = [{"params": list(model.parameters())}]
    else:
        items = list(model_parameters)
        if items and isinstance(items[0], dict):
            raw_groups = items
        elif items and isinstance(items[0], tuple):  # named_parameters()
            raw_groups = [{"params": [p for _, p in items]}]
        else:
            raw_groups = [{"params": items}]
    group_of: dict[int, int] = {}
    hyper: list[dict[str, Any]] = []
    for index, group in enumerate(raw_groups):
        hyper.append({k: v for k, v in group.items() if k != "params"})
        for p in group["params"]:
            group_of.setdefault(id(p), index)
    missing = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in group_of]
    if missing:
        raise ValueError(
            f"model_parameters: {len(missing)} trainable parameter(s) are in no optimizer group "
            f"(first: {missing[:3]}). Add them, or set requires_grad=False on them."
        )
    return hyper, group_of


def transform_model(
    model: nn.Module, config: ZeroshardConfig, layout: ParallelLayout, optimizer: Any, model_parameters: Any
) -> ModelTransforms:
    """AutoEP, expert groups and the optimizer groups, before any flat is built."""
    autoep_settings = load_balancer = autotp = None
    if layout.tensor is not None:
        # AutoTP: Linear layers split over the tensor group before any flat, group or optimizer
        # group is built from the model's parameters (zeroshard/autotp/transform.py).
        from zeroshard.autotp.transform import apply_autotp, repoint_parameters

        if any(is_moe_param(p) for p in model.parameters()):
            raise ValueError(
                f"tensor_parallel.autotp_size={config.tensor_parallel.autotp_size}: the model has DeepSpeed MoE "
                "layers; experts with tensor parallelism are not supported by zeroshard. Use one of them."
            )
        if muon.is_muon_requested(optimizer, config.optimizer):
            raise ValueError(
                f"tensor_parallel.autotp_size={config.tensor_parallel.autotp_size} with a Muon optimizer: Muon "
                "orthogonalises whole matrices and each rank holds a slice of every split one; gathering them over "
                "the tensor group is not built. Use AdamW, or autotp_size 1."
            )
        if model_parameters is not None:  # a generator would read the model after the split
            model_parameters = list(model_parameters)
        autotp = apply_autotp(model, config.tensor_parallel, layout.tensor)
        model_parameters = repoint_parameters(model_parameters, autotp.replaced)
        if isinstance(optimizer, torch.optim.Optimizer):
            for group in optimizer.param_groups:
                group["params"] = repoint_parameters(group["params"], autotp.replaced)
    if config.expert_parallel.enabled:
        # AutoEP: the Hugging Face MoE blocks become expert-parallel layers before any
        # group, flat or optimizer group is built from the model's parameters.
        from zeroshard.moe.autoep.swap import apply_autoep

        autoep_settings, model_parameters = apply_autoep(model, config.expert_parallel, model_parameters)
        if config.expert_parallel.load_balance_coeff is not None:
            from zeroshard.moe.autoep.balance import LoadBalancer
            from zeroshard.moe.autoep.swap import autoep_layers

            load_balancer = LoadBalancer(
                [layer for _, layer in autoep_layers(model)], config.expert_parallel.load_balance_coeff,
                layout.world,
            )
    # MoE layers get their expert-parallel groups (collective, the same order everywhere)
    # before any flat is built: expert flats are sharded over those groups.
    expert_group_names = attach_expert_groups(model, layout)
    if optimizer is None and model_parameters is None and expert_group_names:
        # The optimizer comes from the config: keep expert parameters in groups of their
        # own, as DeepSpeed asks users to (split_params_into_different_moe_groups_for_optimizer).
        model_parameters = split_params_into_different_moe_groups_for_optimizer(
            {"params": [p for p in model.parameters() if p.requires_grad], "name": "dense-params"},
            max_group_size=None,
        )
    hyper, group_of = optimizer_groups(model, model_parameters, optimizer)
    if muon.is_muon_requested(optimizer, config.optimizer):
        # Muon and AdamW parameters in separate groups, hence separate flats (zeroshard/optim/muon/groups.py).
        params_cfg = config.optimizer.params if optimizer is None else None
        hyper, group_of = muon.split_param_groups(model, hyper, group_of, params_cfg)
    return ModelTransforms(hyper, group_of, expert_group_names, autoep_settings, load_balancer, autotp)


def apply_fp8_compute(model: nn.Module, plan: PrecisionPlan, device: torch.device) -> list[str]:
    """`zeroshard.fp8`: refuse a device without fp8 matmuls (outside emulation) and an
    exclude pattern that matches nothing, then swap the chosen Linears for torchao's fp8 ones
    (zeroshard/precision/fp8.py's [Note: fp8 compute]). Returns the swapped modules' names."""
    settings = plan.fp8
    if settings is None:
        return []
    from zeroshard.precision.fp8 import unmatched_patterns

    unmatched = unmatched_patterns(model, settings)
    if unmatched:
        raise ValueError(
            f"zeroshard.fp8.exclude_modules={unmatched}: matches no torch.nn.Linear of the model. Name modules "
            "as model.named_modules() does (fnmatch patterns such as \"blocks.*.mlp.c_proj\"), or remove it."
        )
    from zeroshard.precision.fp8_linear import fp8_device_problem, swap_to_fp8

    problem = fp8_device_problem(device, settings)
    if problem is not None:
        raise ValueError(problem)
    return swap_to_fp8(model, settings)


def cast_module(model: nn.Module, plan: PrecisionPlan) -> dict[int, str]:
    """Give every parameter its group's dtype; floating buffers keep theirs unless the plan
    names a buffer dtype (data_types.buffer_dtype). Returns each parameter's precision group
    name, by id."""
    names = assign_param_groups(plan, model)
    with torch.no_grad():
        for n, p in model.named_parameters():
            dtype = plan.groups[names[n]].param_dtype
            if p.dtype != dtype and p.is_floating_point():
                if init_partition.is_partitioned(p):  # built under zero.Init: cast its part
                    init_partition.cast(p, dtype)
                else:
                    p.data = p.data.to(dtype)
        if plan.buffer_dtype is not None:
            dtype = plan.buffer_dtype
            for buf_name, buf in model.named_buffers():
                if buf.is_floating_point():
                    owner, _, leaf = buf_name.rpartition(".")
                    mod = model.get_submodule(owner) if owner else model
                    mod._buffers[leaf] = buf.to(dtype)
    return {id(p): names[n] for n, p in model.named_parameters()}


def sharding_for(layout: ParallelLayout, expert_group: str | None, split: bool = True) -> ShardingSpec:
    """Expert flats: over their expert-data-parallel group; dense flats: the layout's (with
    tensor parallelism, a flat of whole parameters says they are the same over the tensor group)."""
    if expert_group is not None:
        return layout.expert(expert_group)
    return layout.dense if split else layout.tensor_whole()


def build_units(
    model: nn.Module,
    config: ZeroshardConfig,
    plan: PrecisionPlan,
    policy: StagePolicy,
    layout: ParallelLayout,
    device: torch.device,
    group_of: dict[int, int],
    param_group_name: dict[int, str],
    streams: StreamSet,
) -> list[Unit]:
    """The units and their flat buffers, one unit at a time (after the config's leaf modules
    are marked: a leaf module is never split across units)."""
    apply_leaf_module_config(model, config.zero_optimization.leaf_module)
    extras = config.zeroshard
    specs = plan_units(model, extras.unit_module_classes, extras.unit_min_params)
    threshold = config.zero_optimization.stage3_param_persistence_threshold
    units = []
    for spec in specs:
        # One flat per (precision role, optimizer group, expert group): expert parameters
        # are sharded over their expert-data-parallel group, dense ones over the layout's.
        # With tensor parallelism, pieces and whole parameters go to separate flats: the norm counts
        # a whole one once over its tensor group (ShardingSpec.duplicate).
        classes: dict[tuple[str, int, str | None, bool], tuple[list[str], list[nn.Parameter]]] = {}
        for name, p in zip(spec.param_names, spec.params, strict=False):
            split = layout.tensor is None or hasattr(p, "tp_split")
            key = (param_group_name[id(p)], group_of[id(p)], p.group_name if is_moe_param(p) else None, split)
            classes.setdefault(key, ([], []))
            classes[key][0].append(name)
            classes[key][1].append(p)
        unit_policy = policy
        if not policy.keep_full_params and sum(full_numel(p) for p in spec.params) < threshold:
            # Small units stay resident (stage3_param_persistence_threshold): gathering
            # them would cost more latency than the memory is worth. Such a unit then
            # behaves as at stage 2.
            unit_policy = dataclasses.replace(policy, keep_full_params=True)
        # Built under zero.Init: this unit's parameters are gathered from their parts now,
        # one unit at a time, and the flats below copy them (zeroshard/zero/init.py).
        for p in spec.params:
            init_partition.adopt(p)
        flats = [
            FlatParamGroup(
                spec.name, names, params, plan.groups[role_name],
                opt_group, unit_policy, device, sharding_for(layout, expert_group, split), streams=streams,
                gradients=FlatGradients,
            )
            for (role_name, opt_group, expert_group, split), (names, params) in classes.items()
        ]
        units.append(Unit(spec.name, spec.module, flats))
    for p in init_partition.partitioned_params(model):  # frozen: whole on every rank, as without Init
        init_partition.adopt(p)
    return units


def build_optimizer(
    optimizer: Any,
    config: ZeroshardConfig,
    plan: PrecisionPlan,
    hyper: list[dict[str, Any]],
    flats: list[FlatParamGroup],
    placement: str,
) -> Any:
    """The optimizer over the flats' masters: the user's (re-pointed, or built by a callable)
    or the config's (on the host with offload_optimizer)."""
    masters_by_group: list[list[torch.Tensor]] = [[] for _ in hyper]
    for flat in flats:
        masters_by_group[flat.optimizer_group].append(flat.master)
    param_groups = [dict(h, params=m) for h, m in zip(hyper, masters_by_group, strict=True)]
    state_dtypes = {
        r.optimizer_state_dtype for r in plan.groups.values() if r.optimizer_state_dtype != r.master_dtype
    }
    state_dtype = next(iter(state_dtypes)) if state_dtypes else None
    if optimizer is not None and state_dtype is not None:
        raise ValueError(
            "optimizer: a user optimizer keeps its state in the master weights' dtype, but the plan "
            "asks for another (bf16.bf16_master_weights_and_grads without bf16_optimizer_states). "
            "Configure the optimizer in the config's 'optimizer' section, or set both bf16 options."
        )
    if muon.is_muon_requested(optimizer, config.optimizer):
        params_cfg = config.optimizer.params if optimizer is None else None
        return muon.build_muon(params_cfg, param_groups, flats, state_dtype)
    if isinstance(optimizer, torch.optim.Optimizer):
        check_client_optimizer(optimizer, config.zero_allow_untested_optimizer)
        return repoint_optimizer(optimizer, masters_by_group)
    if callable(optimizer):
        built = optimizer(param_groups)
        check_client_optimizer(built, config.zero_allow_untested_optimizer)
        return built
    if config.optimizer is not None and placement == "host":
        return build_host_optimizer(config.optimizer.type, dict(config.optimizer.params), param_groups, state_dtype)
    if config.optimizer is not None:
        return build_named_optimizer(config.optimizer.type, dict(config.optimizer.params), param_groups, state_dtype)
    return None


def build_scheduler(lr_scheduler: Any, config: ZeroshardConfig, optimizer: Any) -> Any:
    """The user's scheduler (or what its callable builds on the optimizer), else the config's."""
    if lr_scheduler is not None:
        if callable(lr_scheduler) and not hasattr(lr_scheduler, "step"):
            return lr_scheduler(optimizer)
        return lr_scheduler
    if config.scheduler is not None:
        if optimizer is None:
            raise ValueError("scheduler: a scheduler needs an optimizer; set 'optimizer' too.")
        from zeroshard.optim.schedulers import build_scheduler as build_named_scheduler

        return build_named_scheduler(config.scheduler, optimizer)
    return None


def build_gradient_path(
    module: nn.Module,
    units: list[Unit],
    config: ZeroshardConfig,
    policy: StagePolicy,
    layout: ParallelLayout,
    accumulation: Accumulation,
    loss_scaler: LossScaler,
    landing: Callable[[FlatParamGroup, int, int], None] | None,
    streams: StreamSet,
) -> GradientPath:
    """The gradient path with its parts: the bucketed reducer, stages 0-1's `param.grad`
    views and stage 3's gather schedule. The path owns hooks, readiness and reductions; the
    schedule owns when parameters are gathered and freed."""
    flats = [f for unit in units for f in unit.flats]
    zero = config.zero_optimization
    bucket_numel = zero.reduce_bucket_size
    if "reduce_bucket_size" not in zero.model_fields_set:
        bucket_numel = default_bucket_numel(comm.backend_name(layout.dense.shard), flats)

    def divisor() -> int:
        return layout.data_parallel_size * config.gradient_accumulation_steps

    # offload: each reduced bucket goes to the host at once (`landing`); CUDA: reductions on their
    # own stream (zeroshard/sharding/streams.py).
    if config.zeroshard.deterministic_reduction:
        # One fixed tree over the step's micro-batches ([Note: the deterministic reduction]).
        reducer: GradientReducer = TreeReducer(
            flats, divisor, bucket_numel, is_final=accumulation.is_boundary,
            accumulation_steps=lambda: config.gradient_accumulation_steps, landing=landing, streams=streams,
        )
    else:
        reducer = GradientReducer(flats, divisor, bucket_numel, landing=landing, streams=streams)
    schedule = None
    if not policy.keep_full_params:
        # The schedule tells the path when a unit's inputs got their gradient; `path` is the
        # path built below, which owns the schedule (late binding: the two refer to each other).
        schedule = ParamSchedule(
            units, zero.stage3_prefetch_bucket_size, lambda: accumulation.in_backward,
            inputs_reached=lambda unit: path.unit_inputs_reached(unit),
            max_live_numel=zero.stage3_max_live_parameters, reuse_numel=zero.stage3_max_reuse_distance,
        )
    path = GradientPath(
        module, units, policy, reducer, accumulation,
        # A backward of a loss from `engine.scale` is scaled already (engine/api.py).
        loss_scale=lambda: 1.0 if accumulation.prescaled else loss_scaler.scale,
        views=GradViews(flats, policy, lambda: loss_scaler.scale),
        params=schedule,
    )
    return path


def build_dataloader(
    dataset: Any, collate_fn: Any, config: ZeroshardConfig, layout: ParallelLayout, device: torch.device
) -> Any:
    """DeepSpeed's `training_data`: a loader over this rank's share of the samples."""
    from torch.utils.data import DataLoader, DistributedSampler

    drop_last = config.dataloader_drop_last
    # The ranks that see different samples: tensor ranks share theirs.
    data = layout.data or layout.tensor_data or layout.world
    if config.zeroshard.deterministic_reduction:
        # Whole micro-batches dealt round-robin: micro-batch k holds the same samples at every
        # world size (engine/micro_batches.py).
        from zeroshard.engine.micro_batches import MicroBatchSampler

        batches = MicroBatchSampler(
            len(dataset), config.train_micro_batch_size_per_gpu, config.train_batch_size, data.size, data.rank,
            shuffle=True, seed=config.seed or 0, drop_last=drop_last,
        )
        return DataLoader(dataset, batch_sampler=batches, collate_fn=collate_fn, pin_memory=device.type == "cuda")
    sampler = DistributedSampler(
        dataset, num_replicas=data.size, rank=data.rank,
        shuffle=True, seed=config.seed or 0, drop_last=drop_last,
    )
    # Pinned host batches on CUDA: `batch.to(engine.device, non_blocking=True)` then copies
    # asynchronously instead of staging through pageable memory and blocking the host.
    return DataLoader(
        dataset, batch_size=config.train_micro_batch_size_per_gpu,
        sampler=sampler, collate_fn=collate_fn, drop_last=drop_last,
        pin_memory=device.type == "cuda",
    )
