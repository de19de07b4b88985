"""The one validation pass: a raw config in, the frozen, resolved config out.

``resolve_config`` is what ``initialize``, ``zeroshard explain``, the memory estimate, the
optimizer and scheduler builders and checkpoint loading read. It runs every rule: each key's
own (``zeroshard.config.schema._check_config``: types, ranges, the three key classes, the optimizer's
and the schedule's parameters, the batch triangle) and the rules across sections (the
precision plan of ``zeroshard.precision.plan``, Muon's parameters, an optimizer that cannot keep
its state in the dtype the plan asks for). Every problem found is reported in one
``ConfigError``, so ``explain`` and ``initialize`` refuse the same configs with the same message.
"""

from __future__ import annotations

import os
import warnings

from zeroshard.comm.watchdog import resolve_timeouts
from zeroshard.config.accumulation import unmanaged_accumulation_problems
from zeroshard.config.base import _is_auto, _show
from zeroshard.config.deterministic import deterministic_reduction_problems
from zeroshard.config.error import raises_deepspeed_error
from zeroshard.config.offload import offload_stage_problems
from zeroshard.config.schema import (
    PRECISION_KEYS,
    ConfigError,
    ZeroshardConfig,
    _check_config,
    canonical_dtype_name,
)
from zeroshard.config.suggest import did_you_mean
from zeroshard.optim import schedulers
from zeroshard.optim.build import state_dtype_problem
from zeroshard.optim.muon.optimizer import muon_param_problems
from zeroshard.precision.plan import resolve_precision_plan
from zeroshard.resolve.tensor_parallel import tensor_parallel_problems
from zeroshard.sharding.stages import stage_policy

__all__ = ["resolve_config"]


@raises_deepspeed_error
def resolve_config(
    raw: dict | str | os.PathLike, world_size: int = 1, sequence_parallel_size: int | None = None
) -> ZeroshardConfig:
    """Validate and resolve a DeepSpeed-style config for ``world_size`` ranks.

    Args:
        raw: the config as a dict, or the path of a JSON (or HJSON) file holding it.
        world_size: every rank; the batch-size triangle counts data-parallel replicas,
            world_size / sequence_parallel_size.
        sequence_parallel_size: the size of sequence-parallel groups built elsewhere (an mpu);
            None: the config's `sequence_parallel_size` (default 1).

    Returns:
        The frozen config, with ``precision_plan`` and ``stage_policy`` resolved.

    Raises:
        DeepSpeedConfigError (a ConfigError): listing every problem, each as
            ``<key>=<value>: <rule>. <fix>``.
    """
    cfg, problems, tainted = _check_config(raw, world_size, sequence_parallel_size, _SECTION_RULES)
    if cfg is None:
        raise ConfigError(problems)
    if "data_types" not in tainted and (problem := _param_dtype_problem(cfg)):
        problems.append(problem)
    plan = None
    if not tainted & PRECISION_KEYS:
        try:
            plan = resolve_precision_plan(cfg)
        except ConfigError as exc:
            problems.extend(exc.problems)
    problems.extend(offload_stage_problems(cfg.zero_optimization))
    if not tainted & {"zero_optimization", "managed_gradient_accumulation"}:
        problems.extend(unmanaged_accumulation_problems(cfg))
    problems.extend(p for section, p in group_size_problems(cfg, world_size) if section not in tainted)
    if not tainted & {"zeroshard", "sequence_parallel_size", "expert_parallel", "managed_gradient_accumulation",
                      "tensor_parallel"}:
        problems.extend(deterministic_reduction_problems(cfg, world_size))
    if "zeroshard" not in tainted:
        extras = cfg.zeroshard
        problems.extend(resolve_timeouts(
            extras.hang_timeout_s, extras.hang_first_step_timeout_s, extras.collective_timeout_s)[1])
    if "tensor_parallel" not in tainted:
        problems.extend(tensor_parallel_problems(cfg, world_size, plan.mode if plan is not None else None))
    optimizer = cfg.optimizer
    if optimizer is not None and "optimizer" not in tainted:
        if optimizer.type.lower() == "muon":
            problems.extend(muon_param_problems(optimizer.params))
        elif plan is not None and any(
            r.optimizer_state_dtype != r.master_dtype for r in plan.groups.values()
        ) and (problem := state_dtype_problem(optimizer.type, optimizer.params)):
            problems.append(problem)
    if problems:
        raise ConfigError(problems)
    assert plan is not None
    new = [choice for choice in plan.lossy if choice not in _warned_lossy]
    if new:  # explain silences this: it prints the same sentences as LOSSY lines
        _warned_lossy.update(new)
        warnings.warn("zeroshard: lossy precision choices in the config:\n  " + "\n  ".join(new), stacklevel=2)
    cfg._precision_plan = plan
    cfg._stage_policy = stage_policy(cfg.zero_optimization.stage)
    return cfg


def _scheduler_param_problems(raw: dict, path: str) -> list[str]:
    """The schedule's parameters by its own rules (zeroshard.optim.schedulers), without an
    optimizer; `raw` is the config's `scheduler` section as written, at `path`."""
    name, params = raw.get("type"), raw.get("params", {})
    if name not in schedulers.SCHEDULERS or not isinstance(params, dict):
        return []  # an unknown type is the schema's problem
    problems = []
    for kind, key, value, rule in schedulers.param_problems(name, params):
        if kind == "unknown":
            hint = did_you_mean(key, schedulers.accepted_params(name))
            problems.append(f"{path}.params.{key}: unknown parameter of {name}.{hint}")
        elif kind == "missing":
            problems.append(f"{path}.params.{key}: {rule}")
        elif not _is_auto(value):  # "auto" has its own message
            problems.append(f"{path}.params.{key}={_show(value)}: {rule}")
    return problems


# The components' rules the key-by-key check applies to their sections.
_SECTION_RULES = {"scheduler": _scheduler_param_problems}


def group_size_problems(cfg: ZeroshardConfig, world_size: int) -> list[tuple[str, str]]:
    """(section, problem) for every size of rank groups the config asks for that the world
    cannot be cut into; each problem names the key as the user wrote it. The layout builds
    these groups at initialize (zeroshard/sharding/layout.py) and would refuse them there, so
    `zeroshard explain` refuses them here too."""
    problems = []
    ep = cfg.expert_parallel
    if ep.enabled and world_size % ep.autoep_size:
        problems.append(("expert_parallel", (
            f"expert_parallel.autoep_size={ep.autoep_size}: must divide the world size {world_size} (each "
            "layer's experts are spread over autoep_size consecutive ranks). Pick a divisor of the number of "
            "ranks."
        )))
    shard = cfg.zeroshard.shard_group_size
    if shard is not None and world_size % shard:
        problems.append(("zeroshard", (
            f"zeroshard.shard_group_size={shard}: must divide the world size {world_size}. Set it to a divisor "
            "of the number of ranks, or leave it unset to shard over every rank."
        )))
    return problems


def _param_dtype_problem(cfg: ZeroshardConfig) -> str | None:
    """DeepSpeed's rule: ``data_types.param_dtype``, when given, names the enabled mode's dtype."""
    written = cfg.data_types.param_dtype
    if written is None:
        return None
    mode_dtype = "fp16" if cfg.fp16.enabled else "bf16" if cfg.bf16.enabled else "fp32"
    if canonical_dtype_name(written) == mode_dtype:
        return None
    return (
        f'data_types.param_dtype="{written}": must match the enabled precision mode, whose parameters are '
        f"{mode_dtype}. Enable the matching fp16/bf16 section, or remove data_types.param_dtype."
    )


_warned_lossy: set[str] = set()  # each lossy choice is warned about once per process
