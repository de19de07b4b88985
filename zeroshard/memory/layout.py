"""The units and flat buffers an engine would build for a model, without building them.

The prediction follows the engine's own rules: the same unit policy (sharding/units.py), the
same precision groups (precision/plan.py), the same optimizer groups (Muon's split), one flat
per (precision group, optimizer group) of each unit, padded to a multiple of the shard group,
with the stage-3 persistence threshold deciding which units stay whole. Everything here is
sizes and dtypes: the model may live on the meta device or under fake tensors.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from zeroshard.config.schema import ZeroshardConfig
from zeroshard.optim.muon import optimizer as muon
from zeroshard.precision.plan import PrecisionPlan, RolePlan, assign_param_groups
from zeroshard.sharding.flat import master_feeds_gather
from zeroshard.sharding.stages import StagePolicy
from zeroshard.sharding.units import full_numel, plan_units

__all__ = ["FlatShape", "UnitShape", "model_layout"]


@dataclass(frozen=True)
class FlatShape:
    """One flat buffer's sizes and roles on one rank (sharding/flat.py's [Note: flat buffers])."""

    unit: str
    names: tuple[str, ...]
    params: tuple[nn.Parameter, ...]
    role: RolePlan
    optimizer_group: int
    use_muon: bool
    policy: StagePolicy
    shard_size: int
    shard_rank: int
    offload_optimizer: bool
    offload_param: bool

    @property
    def shapes(self) -> list[torch.Size]:
        return [torch.Size(getattr(p, "ds_shape", p.shape)) for p in self.params]

    @property
    def numels(self) -> list[int]:
        return [full_numel(p) for p in self.params]

    @property
    def offsets(self) -> list[int]:
        out, offset = [], 0
        for n in self.numels:
            out.append(offset)
            offset += n
        return out

    @property
    def numel(self) -> int:
        return sum(self.numels)

    @property
    def shard_numel(self) -> int:
        return max(1, -(-self.numel // self.shard_size))

    @property
    def padded_numel(self) -> int:
        return self.shard_numel * self.shard_size

    @property
    def shard_start(self) -> int:
        return self.shard_rank * self.shard_numel

    @property
    def params_sharded(self) -> bool:
        return not self.policy.keep_full_params

    @property
    def gathers_from_master(self) -> bool:
        return self.params_sharded and master_feeds_gather(self.role, self.offload_optimizer or self.offload_param)

    def master_range(self) -> tuple[int, int]:
        if self.policy.shard_optimizer:
            return self.shard_start, self.shard_numel
        return 0, self.padded_numel

    @property
    def master_numel(self) -> int:
        return self.master_range()[1]

    @property
    def master_on_host(self) -> bool:
        return self.offload_optimizer

    @property
    def param_shard_numel(self) -> int:
        """Stage 3's persistent parameter shard (0 when the gathers cast the master)."""
        return self.shard_numel if self.params_sharded and not self.gathers_from_master else 0

    @property
    def master_is_own_copy(self) -> bool:
        """flat.py's `_make_master`: a tensor of its own unless the plan says the masters are the
        parameters and both live in the same place."""
        home = ("host" if self.offload_param else "device") if self.params_sharded else "device"
        place = "host" if self.offload_optimizer else "device"
        return place != home or not self.role.master_is_param


@dataclass(frozen=True)
class UnitShape:
    name: str
    module: nn.Module
    flats: tuple[FlatShape, ...]

    @property
    def numel(self) -> int:
        return sum(f.numel for f in self.flats)

    @property
    def resident(self) -> bool:
        """Stays gathered at stage 3 (below the persistence threshold) or at stages 0-2."""
        return all(not f.params_sharded for f in self.flats)


def _optimizer_groups(model: nn.Module, config: ZeroshardConfig) -> tuple[dict[int, int], set[int]]:
    """(id(param) -> optimizer group, the group indices that use Muon), as the engine's
    transform_model makes them for an optimizer taken from the config."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    hyper: list[dict[str, Any]] = [{}]
    group_of = {id(p): 0 for p in trainable}
    muon_groups: set[int] = set()
    if muon.is_muon_requested(None, config.optimizer):
        hyper, group_of = muon.split_param_groups(model, hyper, group_of, config.optimizer.params)
        muon_groups = {i for i, h in enumerate(hyper) if h.get("use_muon")}
    return group_of, muon_groups


def model_layout(
    model: nn.Module, config: ZeroshardConfig, plan: PrecisionPlan, policy: StagePolicy, world_size: int, rank: int = 0
) -> list[UnitShape]:
    """The units (root first) and their flats, as `engine/setup.py`'s build_units would make them
    for `model` on `world_size` ranks (dense parameters sharded over every rank)."""
    extras = config.zeroshard
    zero = config.zero_optimization
    group_names = assign_param_groups(plan, model)
    name_of = {id(p): n for n, p in model.named_parameters()}
    group_of, muon_groups = _optimizer_groups(model, config)
    offload_param = zero.param_offload and policy.stage == 3
    units = []
    for spec in plan_units(model, extras.unit_module_classes, extras.unit_min_params):
        classes: dict[tuple[str, int], tuple[list[str], list[nn.Parameter]]] = {}
        for name, p in zip(spec.param_names, spec.params, strict=False):
            key = (group_names[name_of.get(id(p), name)], group_of[id(p)])
            names, params = classes.setdefault(key, ([], []))
            names.append(name)
            params.append(p)
        unit_policy = policy
        threshold = zero.stage3_param_persistence_threshold
        if not policy.keep_full_params and sum(full_numel(p) for p in spec.params) < threshold:
            unit_policy = dataclasses.replace(policy, keep_full_params=True)
        flats = tuple(
            FlatShape(
                spec.name, tuple(names), tuple(params), plan.groups[role], opt_group, opt_group in muon_groups,
                unit_policy, world_size, rank, zero.optimizer_offload, offload_param,
            )
            for (role, opt_group), (names, params) in classes.items()
        )
        units.append(UnitShape(spec.name, spec.module, flats))
    return units
