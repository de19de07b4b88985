"""The Engine: composes units, flat buffers, the gradient path, the parameter schedule and
the optimizer step; the DeepSpeed training-loop API.

Orchestration only. Which ranks shard what is the ParallelLayout (layout.py); what a stage
does is a `StagePolicy` (stages.py); a gradient's way from hook to reduced shard is
grad_path.py; stage 3's gathers and frees are param_schedule.py; the step (unscale, norm,
clip, optimizer, publish) is step.py; dtypes come from the PrecisionPlan (precision.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from zeroshard.comm import collectives as comm
from zeroshard.comm import faults
from zeroshard.config.schema import ZeroshardConfig
from zeroshard.engine.api import EngineAPI
from zeroshard.grads.path import GradientPath
from zeroshard.grads.reduce import GradientReducer, default_bucket_numel
from zeroshard.grads.views import GradViews
from zeroshard.launch.device import select_device
from zeroshard.moe.utils import (
    attach_expert_groups,
    is_moe_param,
    split_params_into_different_moe_groups_for_optimizer,
)
from zeroshard.optim import build_optimizer, repoint_optimizer
from zeroshard.optim.muon import optimizer as muon
from zeroshard.precision.autocast import forward_context
from zeroshard.precision.loss_scale import make_loss_scaler
from zeroshard.precision.plan import PrecisionPlan, assign_param_groups
from zeroshard.sharding.flat import FlatParamGroup
from zeroshard.sharding.layout import ParallelLayout, establish
from zeroshard.sharding.leaf_modules import apply_leaf_module_config
from zeroshard.sharding.offload import OffloadPlan, build_host_optimizer, place_layout
from zeroshard.sharding.registry import ParamRegistry
from zeroshard.sharding.schedule import ParamSchedule
from zeroshard.sharding.stages import stage_policy
from zeroshard.sharding.streams import streams_for
from zeroshard.sharding.unit import Unit
from zeroshard.sharding.units import plan_units
from zeroshard.step.optimizer_step import OptimizerStep, StepResult
from zeroshard.zero import partition as init_partition

logger = logging.getLogger("zeroshard")


def _optimizer_groups(
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


class Engine(EngineAPI):
    """A model wrapped for ZeRO data-parallel training (DeepSpeed's engine surface)."""

    def __init__(
        self,
        model: nn.Module,
        config: ZeroshardConfig,
        plan: PrecisionPlan,
        optimizer: Any = None,
        model_parameters: Any = None,
        lr_scheduler: Any = None,
        training_data: Any = None,
        collate_fn: Any = None,
        layout: ParallelLayout | None = None,
    ) -> None:
        self.config = config
        self.precision_plan = plan
        self.policy = stage_policy(config.zero_optimization.stage)
        layout = layout if layout is not None else establish(
            config.zeroshard.shard_group_size, config.zeroshard.collective_timeout_s
        )
        self.offload = OffloadPlan.from_config(config.zero_optimization)
        self.layout = place_layout(layout, self.offload)  # where each role lives (offload.py)
        self.world_size = self.layout.world_size
        self.global_rank = self.layout.rank
        # Sequence ranks share samples: gradients average over data-parallel replicas only.
        self.data_parallel_size = self.layout.data_parallel_size
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        self.device = select_device(model)
        # Not moved yet: cast first, then each unit's flat buffer is built on the device one at
        # a time (at stage 3 only its shard stays there), then the rest follows (see below).
        self.module = model
        self.global_steps = 0
        self.micro_steps = 0
        self.skipped_steps = 0
        self.global_samples = 0
        self._step_applied = False
        self._in_step = False  # the boundary, with managed_gradient_accumulation false
        self._backwards_at_last_step = 0
        self._backward_prescaled = False
        self._boundary_override: bool | None = None
        self._stepped_after_backward = -1  # backward_count at the last step() call
        # The last step's norms as device scalars: read (a host sync) only when asked for.
        self._global_grad_norm: torch.Tensor | None = None
        self._post_clip_grad_norm: torch.Tensor | None = None
        self._autocast_warned: set[str] = set()  # autocast.forward_context warns once per engine

        if config.expert_parallel.enabled:
            # AutoEP: the Hugging Face MoE blocks become expert-parallel layers before any
            # group, flat or optimizer group is built from the model's parameters.
            from zeroshard.moe.autoep.swap import apply_autoep

            self.autoep_settings, model_parameters = apply_autoep(model, config.expert_parallel, model_parameters)
        self._load_balancer = None
        if config.expert_parallel.enabled and config.expert_parallel.load_balance_coeff is not None:
            from zeroshard.moe.autoep.balance import LoadBalancer
            from zeroshard.moe.autoep.swap import autoep_layers

            self._load_balancer = LoadBalancer(
                [layer for _, layer in autoep_layers(model)], config.expert_parallel.load_balance_coeff,
                self.layout.world,
            )
        # MoE layers get their expert-parallel groups (collective, the same order everywhere)
        # before any flat is built: expert flats are sharded over those groups.
        self.expert_group_names = attach_expert_groups(model, self.layout)
        if optimizer is None and model_parameters is None and self.expert_group_names:
            # The optimizer comes from the config: keep expert parameters in groups of their
            # own, as DeepSpeed asks users to (split_params_into_different_moe_groups_for_optimizer).
            model_parameters = split_params_into_different_moe_groups_for_optimizer(
                {"params": [p for p in model.parameters() if p.requires_grad], "name": "dense-params"},
                max_group_size=None,
            )
        hyper, group_of = _optimizer_groups(model, model_parameters, optimizer)
        if muon.is_muon_requested(optimizer, config.optimizer):
            # Muon and AdamW parameters in separate groups, hence separate flats (optim/muon.py).
            params_cfg = config.optimizer.params if optimizer is None else None
            hyper, group_of = muon.split_param_groups(model, hyper, group_of, params_cfg)
        self._cast_module(model)
        apply_leaf_module_config(model, config.zero_optimization.leaf_module)
        self.units = self._build_units(model, group_of)
        self.flats = [f for unit in self.units for f in unit.flats]
        # The trainable parameters are views of the flats, already on the device; this moves
        # the buffers and frozen parameters. So the device never holds the whole fp32 model:
        # at most the cast model (stages 0-2) or one unit's full flat beside the shards (stage 3).
        model.to(self.device)

        masters_by_group: list[list[torch.Tensor]] = [[] for _ in hyper]
        for flat in self.flats:
            masters_by_group[flat.optimizer_group].append(flat.master)
        self.loss_scaler = make_loss_scaler(plan.loss_scale)
        zero = config.zero_optimization
        self._step = OptimizerStep(
            self.flats, self.layout, plan.check_grad_overflow, self.loss_scaler,
            config.gradient_clipping, zero.allgather_bucket_size, self.device,
            is_final=self.is_gradient_accumulation_boundary,
        )
        self.optimizer = self._make_optimizer(optimizer, hyper, masters_by_group)
        self.lr_scheduler = self._make_scheduler(lr_scheduler)
        self._registry = ParamRegistry(self.flats, lambda: self.loss_scaler.scale, lambda: self.optimizer)

        # The gradient path owns hooks, readiness and reductions; stage 3's schedule owns
        # when parameters are gathered and freed. The engine only wires them together.
        bucket_numel = zero.reduce_bucket_size
        if "reduce_bucket_size" not in zero.model_fields_set:
            bucket_numel = default_bucket_numel(comm.backend_name(self.layout.dense.shard), self.flats)
        reducer = GradientReducer(
            self.flats,
            divisor=lambda: self.data_parallel_size * self.config.gradient_accumulation_steps,
            bucket_numel=bucket_numel,
        )
        if self._step.host_grads is not None:  # offload: each reduced bucket goes to the host at once
            reducer.landing = self._step.host_grads.land
        # CUDA: all-gathers and reductions on their own streams (zeroshard/sharding/streams.py's note).
        streams = streams_for(self.device)
        reducer.streams = streams
        for flat in self.flats:
            flat.streams = streams
        self._grads = GradientPath(
            self.module, self.units, self.policy, reducer,
            # A backward of a loss from `engine.scale` is scaled already (engine_api.py).
            loss_scale=lambda: 1.0 if self._backward_prescaled else self.loss_scaler.scale,
            is_boundary=self.is_gradient_accumulation_boundary,
        )
        self._grads.views = GradViews(self.flats, self.policy, lambda: self.loss_scaler.scale)
        if not self.policy.keep_full_params:
            self._grads.params = ParamSchedule(
                self.units, zero.stage3_prefetch_bucket_size, lambda: self._grads.in_backward,
                inputs_reached=self._grads.unit_inputs_reached,
            )
        self.training_dataloader = (
            self._make_dataloader(training_data, collate_fn) if training_data is not None else None
        )

    # ------------------------------------------------------------------ setup
    def _cast_module(self, model: nn.Module) -> None:
        """Give every parameter its group's dtype; floating buffers keep theirs unless the plan
        names a buffer dtype (data_types.buffer_dtype)."""
        names = assign_param_groups(self.precision_plan, model)
        self._param_group_name = {id(p): names[n] for n, p in model.named_parameters()}
        with torch.no_grad():
            for n, p in model.named_parameters():
                dtype = self.precision_plan.groups[names[n]].param_dtype
                if p.dtype != dtype and p.is_floating_point():
                    if init_partition.is_partitioned(p):  # built under zero.Init: cast its part
                        init_partition.cast(p, dtype)
                    else:
                        p.data = p.data.to(dtype)
            if self.precision_plan.buffer_dtype is not None:
                dtype = self.precision_plan.buffer_dtype
                for buf_name, buf in model.named_buffers():
                    if buf.is_floating_point():
                        owner, _, leaf = buf_name.rpartition(".")
                        mod = model.get_submodule(owner) if owner else model
                        mod._buffers[leaf] = buf.to(dtype)

    def _build_units(self, model: nn.Module, group_of: dict[int, int]) -> list[Unit]:
        extras = self.config.zeroshard
        specs = plan_units(model, extras.unit_module_classes, extras.unit_min_params)
        units = []
        for spec in specs:
            # One flat per (precision role, optimizer group, expert group): expert parameters
            # are sharded over their expert-data-parallel group, dense ones over the layout's.
            classes: dict[tuple[str, int, str | None], tuple[list[str], list[nn.Parameter]]] = {}
            for name, p in zip(spec.param_names, spec.params, strict=False):
                key = (self._param_group_name[id(p)], group_of[id(p)], p.group_name if is_moe_param(p) else None)
                classes.setdefault(key, ([], []))
                classes[key][0].append(name)
                classes[key][1].append(p)
            policy = self.policy
            threshold = self.config.zero_optimization.stage3_param_persistence_threshold
            if not policy.keep_full_params and sum(init_partition.full_numel(p) for p in spec.params) < threshold:
                # Small units stay resident (stage3_param_persistence_threshold): gathering
                # them would cost more latency than the memory is worth. Such a unit then
                # behaves as at stage 2.
                policy = dataclasses.replace(policy, keep_full_params=True)
            # Built under zero.Init: this unit's parameters are gathered from their parts now,
            # one unit at a time, and the flats below copy them (zeroshard/zero/init.py).
            for p in spec.params:
                init_partition.adopt(p)
            flats = [
                FlatParamGroup(
                    spec.name, names, params, self.precision_plan.groups[role_name],
                    opt_group, policy, self.device, self._sharding(expert_group),
                )
                for (role_name, opt_group, expert_group), (names, params) in classes.items()
            ]
            units.append(Unit(spec.name, spec.module, flats))
        for p in init_partition.partitioned_params(model):  # frozen: whole on every rank, as without Init
            init_partition.adopt(p)
        return units

    def _sharding(self, expert_group: str | None):
        """Expert flats: over their expert-data-parallel group; dense flats: the layout's."""
        if expert_group is None:
            return self.layout.dense
        return self.layout.expert(expert_group)

    def _make_optimizer(self, optimizer, hyper, masters_by_group):
        groups = [dict(h, params=m) for h, m in zip(hyper, masters_by_group, strict=True)]
        state_dtypes = {
            r.optimizer_state_dtype for r in self.precision_plan.groups.values()
            if r.optimizer_state_dtype != r.master_dtype
        }
        state_dtype = next(iter(state_dtypes)) if state_dtypes else None
        if optimizer is not None and state_dtype is not None:
            raise ValueError(
                "optimizer: a user optimizer keeps its state in the master weights' dtype, but the plan "
                "asks for another (bf16.bf16_master_weights_and_grads without bf16_optimizer_states). "
                "Configure the optimizer in the config's 'optimizer' section, or set both bf16 options."
            )
        if muon.is_muon_requested(optimizer, self.config.optimizer):
            params_cfg = self.config.optimizer.params if optimizer is None else None
            return muon.build_muon(params_cfg, groups, self.flats, state_dtype)
        if isinstance(optimizer, torch.optim.Optimizer):
            return repoint_optimizer(optimizer, masters_by_group)
        if callable(optimizer):
            return optimizer(groups)
        if self.config.optimizer is not None and self._step.placement == "host":
            return build_host_optimizer(
                self.config.optimizer.type, dict(self.config.optimizer.params), groups, state_dtype
            )
        if self.config.optimizer is not None:
            return build_optimizer(
                self.config.optimizer.type, dict(self.config.optimizer.params), groups, state_dtype
            )
        return None

    def _make_scheduler(self, lr_scheduler):
        if lr_scheduler is not None:
            if callable(lr_scheduler) and not hasattr(lr_scheduler, "step"):
                return lr_scheduler(self.optimizer)
            return lr_scheduler
        if self.config.scheduler is not None:
            if self.optimizer is None:
                raise ValueError("scheduler: a scheduler needs an optimizer; set 'optimizer' too.")
            from zeroshard.optim.schedulers import build_scheduler

            return build_scheduler(self.config.scheduler, self.optimizer)
        return None

    def _make_dataloader(self, dataset, collate_fn):
        from torch.utils.data import DataLoader, DistributedSampler

        drop_last = self.config.dataloader_drop_last
        data = self.layout.data if self.layout.data is not None else self.layout.world
        sampler = DistributedSampler(
            dataset, num_replicas=data.size, rank=data.rank,
            shuffle=True, seed=self.config.seed or 0, drop_last=drop_last,
        )
        # Pinned host batches on CUDA: `batch.to(engine.device, non_blocking=True)` then copies
        # asynchronously instead of staging through pageable memory and blocking the host.
        return DataLoader(
            dataset, batch_size=self.config.train_micro_batch_size_per_gpu,
            sampler=sampler, collate_fn=collate_fn, drop_last=drop_last,
            pin_memory=self.device.type == "cuda",
        )

    # ---------------------------------------------------------------- forward
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the module under the precision policy (autocast, input casts)."""
        faults.where.step = self.global_steps
        param_dtype = next(iter(self.precision_plan.groups.values())).param_dtype
        if self.precision_plan.mode in ("bf16", "fp16"):

            def cast(x):
                if isinstance(x, torch.Tensor) and x.is_floating_point():
                    return x.to(param_dtype)
                return x

            args, kwargs = tree_map(cast, (args, kwargs))
        with forward_context(self.precision_plan, self.device.type, self._autocast_warned):
            return self.module(*args, **kwargs)

    __call__ = forward

    # --------------------------------------------------------------- backward
    def backward(
        self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True, **kwargs: Any
    ) -> torch.Tensor:
        """`loss.backward()` with the engine's loss scaling; the same as calling it yourself.

        Every backward's gradient is divided by `gradient_accumulation_steps` (in the
        reduction); `scale_wrt_gas=False` leaves this one's undivided, as DeepSpeed's argument
        does. Returns `loss / gradient_accumulation_steps` (`loss` with `scale_wrt_gas=False`).
        """
        accumulation = self.config.gradient_accumulation_steps
        faults.where.step = self.global_steps
        before = self._grads.backward_count
        (loss if scale_wrt_gas or accumulation == 1 else loss * accumulation).backward(
            retain_graph=retain_graph, **kwargs
        )
        if self._grads.backward_count == before:
            # Nothing in the model took part (no hook fired): still run the epilogue, so this
            # rank issues the same collectives as ranks whose loss did reach the model.
            self._grads.run_epilogue()
        return loss / accumulation if scale_wrt_gas else loss

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Backward calls inside keep their gradients local (no communication)."""
        return self._grads.no_sync()

    def is_gradient_accumulation_boundary(self) -> bool:
        if not self.config.managed_gradient_accumulation:
            return self._in_step  # unmanaged: step() is the boundary
        if self._coalesced:
            return True  # the step after a coalesce_grad_reduction block
        if self._boundary_override is not None:
            return self._boundary_override
        return (self.micro_steps + 1) % self.config.gradient_accumulation_steps == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        if not self.config.managed_gradient_accumulation:
            raise RuntimeError(
                "set_gradient_accumulation_boundary(): with managed_gradient_accumulation false, every "
                "engine.step() is the boundary. Call step() when the accumulation ends, or set "
                "managed_gradient_accumulation to true."
            )
        self._boundary_override = bool(is_boundary)

    # ------------------------------------------------------------------- step
    def step(self) -> None:
        """The optimizer step, at the accumulation boundary only (with
        managed_gradient_accumulation false, every step() is the boundary).

        A second call for the same step (no backward since the last `step()`) changes
        nothing: no optimizer step, no counter moves, so Adam's bias correction is what one
        call gives. Every rank counts the same backwards (a rank whose loss missed the model
        still runs the backward epilogue in `engine.backward`), so they agree on it.
        """
        if not self._grads.sync_enabled:
            block = "coalesce_grad_reduction()" if self._in_coalesce else "no_sync()"
            raise RuntimeError(f"engine.step() inside {block}: leave the with-block first.")
        self._step_applied = False
        if self._grads.backward_count == self._stepped_after_backward:
            return
        self._stepped_after_backward = self._grads.backward_count
        self._in_step = True
        try:
            if self.is_gradient_accumulation_boundary():
                if self.optimizer is None:
                    raise RuntimeError(
                        "engine.step(): no optimizer. Set 'optimizer' in the config or pass optimizer=."
                    )
                self._grads.flush()
                if self._grads.params is not None:
                    # A unit pinned by a forward no backward followed would keep stale values
                    # after the update (param_schedule.py's [Note: pinned units]).
                    self._grads.params.free_all()
                faults.where.step = self.global_steps
                position = (self.global_steps, self._grads.training_forwards)
                self._grads.training_forwards = 0
                # Applies .grad changed in place through the views (stages 0-1, grad_views.py).
                result = self._step.run(self._grads.reducer.take_local_sum(), position)
                self._grads.views.clear()
                self._global_grad_norm = result.norm_tensor
                self._post_clip_grad_norm = result.post_clip_tensor
                if result.overflow:
                    self.skipped_steps += 1
                if not result.finite:
                    self._log_nonfinite(result)
                self._step_applied = not result.overflow
                if self._load_balancer is not None:  # AutoEP's selection bias, once per step
                    self._load_balancer.step(self._step_applied)
                self._log_step(result)
                self.global_steps += 1
                self._count_samples()
        finally:
            self._in_step = False
            self._coalesced = False
        self.micro_steps += 1

    def _log_nonfinite(self, result: StepResult) -> None:
        ranks = ", ".join(map(str, result.nonfinite_ranks)) or "none (finite gradients whose squares overflowed)"
        if result.overflow:
            what = f"step skipped (skipped_steps {self.skipped_steps})"
        else:
            what = f"step taken anyway: {self.precision_plan.overflow_keys} is false"
        # fp16's dynamic loss scale overflows by design while it searches: not a warning there.
        searching = self.precision_plan.loss_scale.kind in ("dynamic", "grad_scaler")
        level = logging.INFO if searching else logging.WARNING
        logger.log(
            level, "step %d: non-finite gradient norm %s from rank(s) %s; %s (loss scale %s)",
            self.global_steps, result.norm, ranks, what, result.scale,
        )

    def _log_step(self, result: StepResult) -> None:
        steps_per_print = self.config.steps_per_print
        if self.global_rank == 0 and steps_per_print and (self.global_steps + 1) % steps_per_print == 0:
            logger.info(
                "step %d: lr %s grad_norm %.4g (after clipping %.4g) loss_scale %s",
                self.global_steps + 1, self.get_lr(), result.norm, result.post_clip_norm, result.scale,
            )

    def zero_grad(self) -> None:
        """Drop every accumulated gradient (local and reduced)."""
        self._grads.zero_grad()

    # ------------------------------------------------------------- checkpoints
    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest: bool = True):
        """Write this rank's shards and the shared index under save_dir/tag (atomic)."""
        from zeroshard import checkpoint

        return checkpoint.save_checkpoint(self, save_dir, tag, client_state, save_latest)

    def load_checkpoint(
        self, load_dir, tag=None, load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True, load_module_only: bool = False, allow_pickle: bool = False,
    ):
        """Load a checkpoint saved on any world size and stage; returns (path, client_state)."""
        from zeroshard import checkpoint

        return checkpoint.load_checkpoint(
            self, load_dir, tag, load_optimizer_states=load_optimizer_states,
            load_lr_scheduler_states=load_lr_scheduler_states, load_module_only=load_module_only,
            allow_pickle=allow_pickle,
        )

    def save_16bit_model(self, save_dir, save_filename: str = "pytorch_model.safetensors"):
        """The consolidated module weights in the parameter dtype, for inference (rank 0 writes)."""
        from zeroshard import checkpoint

        return checkpoint.save_16bit_model(self, save_dir, save_filename)

    # -------------------------------------------------------------- accessors
    @property
    def optimizer(self) -> Any:
        return self._step.optimizer

    @optimizer.setter
    def optimizer(self, value: Any) -> None:
        self._step.optimizer = value

    @property
    def lr_scheduler(self) -> Any:
        return self._step.lr_scheduler

    @lr_scheduler.setter
    def lr_scheduler(self, value: Any) -> None:
        self._step.lr_scheduler = value

    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.scale

    def get_global_grad_norm(self) -> float | None:
        """The pre-clip global gradient norm of the last optimizer step (read from the device
        now: the step itself does not wait for it)."""
        return None if self._global_grad_norm is None else float(self._global_grad_norm)

    def get_post_clip_grad_norm(self) -> float | None:
        return None if self._post_clip_grad_norm is None else float(self._post_clip_grad_norm)

    def get_lr(self) -> list[float]:
        if self.optimizer is None:
            return []
        return [g["lr"] for g in self.optimizer.param_groups]

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.config.train_micro_batch_size_per_gpu

    def gradient_accumulation_steps(self) -> int:
        return self.config.gradient_accumulation_steps

    def train_batch_size(self) -> int:
        return self.config.train_batch_size

    @property
    def seq_parallel_group(self) -> Any:
        """The sequence-parallel torch ProcessGroup (None without sequence parallelism)."""
        return None if self.layout.sequence is None else self.layout.sequence.handle

    @property
    def data_parallel_group(self) -> Any:
        """The data-parallel torch ProcessGroup: ranks that see different samples."""
        return (self.layout.data if self.layout.data is not None else self.layout.world).handle

    def train(self, mode: bool = True) -> Engine:
        self.module.train(mode)
        return self

    def eval(self) -> Engine:
        self.module.eval()
        return self

    def parameters(self, recurse: bool = True):
        return self.module.parameters(recurse)

    def named_parameters(self, *args, **kwargs):
        return self.module.named_parameters(*args, **kwargs)

    def locate(self, param: nn.Parameter) -> tuple[FlatParamGroup, int]:
        """The flat buffer holding `param` and its index there."""
        return self._registry.locate(param)
