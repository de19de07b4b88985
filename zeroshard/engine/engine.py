"""The Engine: composes units, flat buffers, the gradient path, the parameter schedule and
the optimizer step; the DeepSpeed training-loop API.

Orchestration only. The parts are built in setup.py; which ranks shard what is the
ParallelLayout (sharding/layout.py); what a stage does is a `StagePolicy` (sharding/stages.py);
where accumulation stands is the `Accumulation` (grads/accumulation.py); a gradient's way from
hook to reduced shard is grads/path.py; stage 3's gathers and frees are sharding/schedule.py;
the step (unscale, norm, clip, optimizer, publish) is step/optimizer_step.py; dtypes come from
the PrecisionPlan (precision/plan.py).
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from zeroshard.checkpoint.preempt import Preemption
from zeroshard.comm import faults
from zeroshard.engine import deterministic, setup
from zeroshard.engine.api import EngineAPI
from zeroshard.engine.compile import CompileMixin
from zeroshard.engine.hf_compat import HFCompat
from zeroshard.engine.parameter_offload import attach_parameter_offload
from zeroshard.engine.watch import call, forward_call, start_watching
from zeroshard.grads.accumulation import Accumulation
from zeroshard.launch.device import select_device
from zeroshard.memory.guard import MemoryGuard
from zeroshard.monitor.attach import build_monitoring
from zeroshard.monitor.master import MonitorMaster
from zeroshard.optim.muon.qk_clip.attach import attach_qk_clip
from zeroshard.precision.autocast import forward_context
from zeroshard.precision.loss_scale import make_loss_scaler
from zeroshard.precision.plan import FP8_WIRE_DTYPE, GROUP_FP8
from zeroshard.sharding.fp8_gather import attach_fp8_gathers
from zeroshard.sharding.layout import ParallelLayout, establish
from zeroshard.sharding.offload import OffloadPlan, place_layout
from zeroshard.sharding.registry import ParamRegistry
from zeroshard.sharding.streams import streams_for
from zeroshard.step.optimizer_step import OptimizerStep
from zeroshard.zero.param_attributes import mark_stage3

if TYPE_CHECKING:
    from zeroshard.config.schema import ZeroshardConfig
    from zeroshard.sharding.flat import FlatParamGroup
    from zeroshard.step.optimizer_step import StepResult

logger = logging.getLogger("zeroshard")


class Engine(CompileMixin, HFCompat, EngineAPI):
    """A model wrapped for ZeRO data-parallel training (DeepSpeed's engine surface)."""

    def __init__(
        self,
        model: nn.Module,
        config: ZeroshardConfig,
        optimizer: Any = None,
        model_parameters: Any = None,
        lr_scheduler: Any = None,
        training_data: Any = None,
        collate_fn: Any = None,
        layout: ParallelLayout | None = None,
    ) -> None:
        self.config = config
        # Both resolved once, by the resolve pass (zeroshard/resolve/rules.py), with the config.
        self.precision_plan = plan = config.precision_plan
        self.policy = config.stage_policy
        layout = layout if layout is not None else establish(
            config.zeroshard.shard_group_size, config.zeroshard.collective_timeout_s
        )
        self.offload = OffloadPlan.from_config(config.zero_optimization)
        self.layout = place_layout(layout, self.offload)  # where each role lives (offload.py)
        # The deterministic reduction (engine/deterministic.py) cuts shards at its norm's blocks.
        self.deterministic = config.zeroshard.deterministic_reduction
        if self.deterministic:
            self.layout = deterministic.aligned_layout(self.layout)
        self.world_size = self.layout.world_size
        self.global_rank = self.layout.rank
        # Sequence ranks share samples: gradients average over data-parallel replicas only.
        self.data_parallel_size = self.layout.data_parallel_size
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        # DeepSpeed's monitors first: one that cannot start refuses the config on every rank
        # before the model is touched (zeroshard/monitor/master.py).
        self.monitor = MonitorMaster(config, self.global_rank, self.layout.world)
        self.device = select_device(model)
        # Not moved yet: cast first, then each unit's flat buffer is built on the device one at
        # a time (at stage 3 only its shard stays there), then the rest follows (see below).
        self.module = model
        self.accumulation = Accumulation(config)
        # The last step's norms as device scalars: read (a host sync) only when asked for.
        self._global_grad_norm: torch.Tensor | None = None
        self._post_clip_grad_norm: torch.Tensor | None = None
        self._autocast_warned: set[str] = set()  # autocast.forward_context warns once per engine

        transforms = setup.transform_model(model, config, self.layout, optimizer, model_parameters)
        self.autoep_settings = transforms.autoep_settings
        self._load_balancer = transforms.load_balancer
        self.expert_group_names = transforms.expert_group_names
        if self.deterministic:
            deterministic.check_expert_groups(self.layout, self.expert_group_names)
        # AutoTP: the split (plan, group); the first batch is checked equal across the tensor group.
        self.autotp = transforms.autotp
        if self.autotp is not None:
            from zeroshard.autotp.input_check import check_inputs_once

            check_inputs_once(model, self.layout.tensor)
        self.fp8_modules = setup.apply_fp8_compute(model, plan, self.device)
        self._cast_module(model)
        # The memory budget (zeroshard/memory/guard.py): refused here, before any flat is built,
        # if the states alone cannot fit; again at the first forward with the real inputs.
        self.memory_guard = MemoryGuard(
            config, self.layout.world, self.device, traced=not self.expert_group_names and self.autotp is None,
            untraced_reason="tensor-parallel model" if self.autotp is not None else "expert-parallel model",
        )
        self.memory_guard.check_states(model)
        streams = streams_for(self.device)  # CUDA: gathers and reductions on their own streams
        self.units = setup.build_units(
            model, config, plan, self.policy, self.layout, self.device,
            transforms.group_of, self._param_group_name, streams,
        )
        self.flats = [f for unit in self.units for f in unit.flats]
        # Stage 3: DeepSpeed's ds_id, ds_persist, ... on each parameter (zeroshard/zero/param_attributes.py).
        mark_stage3(model, self.flats, stage3=not self.policy.keep_full_params)
        self.memory_guard.attach_unit_names(self.units)
        # Stage 3: the fp8 Linears' weights are gathered in fp8 (sharding/fp8_gather.py).
        self._fp8_scales = attach_fp8_gathers(self.flats, GROUP_FP8, FP8_WIRE_DTYPE) if plan.fp8 else []
        # The trainable parameters are views of the flats, already on the device; this moves
        # the buffers and frozen parameters. So the device never holds the whole fp32 model:
        # at most the cast model (stages 0-2) or one unit's full flat beside the shards (stage 3).
        model.to(self.device)

        self.loss_scaler = make_loss_scaler(plan.loss_scale)
        zero = config.zero_optimization
        self._step = OptimizerStep(
            self.flats, self.layout, plan.check_grad_overflow, self.loss_scaler,
            config.gradient_clipping, zero.allgather_bucket_size, self.device,
            is_final=self.accumulation.is_boundary, deterministic=self.deterministic,
        )
        self.optimizer = setup.build_optimizer(
            optimizer, config, plan, transforms.hyper, self.flats, self._step.placement
        )
        if self.deterministic and hasattr(self.optimizer, "batch_across_tasks"):
            self.optimizer.batch_across_tasks = False  # Muon: one Newton-Schulz call per matrix
        # MuonClip (optim/muon/qk_clip/): logit capture in attention, rescaling after each step.
        self.qk_clip = attach_qk_clip(model, config, self.flats, self.layout, self.optimizer, self.device)
        self.lr_scheduler = setup.build_scheduler(lr_scheduler, config, self.optimizer)
        self._registry = ParamRegistry(self.flats, lambda: self.loss_scaler.scale, lambda: self.optimizer)
        host_grads = self._step.host_grads
        self._grads = setup.build_gradient_path(
            self.module, self.units, config, self.policy, self.layout, self.accumulation, self.loss_scaler,
            landing=host_grads.land if host_grads is not None else None, streams=streams,
        )
        self.training_dataloader = (
            self._make_dataloader(training_data, collate_fn) if training_data is not None else None
        )
        # ---- monitoring (zeroshard/monitor/): timers, FLOPs, collectives, MoE figures; DeepSpeed's
        # engine.monitor (csv, tensorboard, wandb) and engine.metrics(), which joins both.
        self.figures, self.training_figures = build_monitoring(
            self.module, config, self.device, self.global_rank, self.optimizer, self.monitor, fp16=plan.mode == "fp16"
        )
        self.timers = self.figures.timers
        attach_parameter_offload(self)  # stage 3: the internals TRL reads (engine/parameter_offload.py)
        # Signal handlers, the stop vote in the step's all-reduce, resume (checkpoint/preempt.py).
        self.preemption = Preemption(self)
        # The hang watchdog and the channels that keep diverging ranks off one transport (engine/watch.py).
        start_watching(self)

    def _cast_module(self, model: nn.Module) -> None:
        """Give every parameter its precision group's dtype (setup.cast_module)."""
        self._param_group_name = setup.cast_module(model, self.precision_plan)

    def _make_dataloader(self, dataset, collate_fn):
        return setup.build_dataloader(dataset, collate_fn, self.config, self.layout, self.device)

    # ---------------------------------------------------------------- forward
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the module under the precision policy (autocast, input casts)."""
        with call(self, forward_call(self)), self.timers.span("fwd"), self.memory_guard.phase("forward"):
            self.memory_guard.check_first_forward(self.module, args, kwargs)
            self.figures.before_forward(self.global_steps)
            output = self._forward(*args, **kwargs)
            self.figures.after_forward()
            return output

    def _forward(self, *args: Any, **kwargs: Any) -> Any:
        faults.where.step = self.global_steps
        param_dtype = next(iter(self.precision_plan.groups.values())).param_dtype
        if self.precision_plan.mode in ("bf16", "fp16"):

            def cast(x):
                if isinstance(x, torch.Tensor) and x.is_floating_point():
                    return x.to(param_dtype)
                return x

            args, kwargs = tree_map(cast, (args, kwargs))
        rng = deterministic.forward_rng(self) if self.deterministic else contextlib.nullcontext()
        with forward_context(self.precision_plan, self.device.type, self._autocast_warned), rng:
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
        with call(self, "backward"), self.timers.span("bwd"), self.memory_guard.phase("backward"):
            return self._backward(loss, retain_graph, scale_wrt_gas, **kwargs)

    def _backward(self, loss: torch.Tensor, retain_graph: bool, scale_wrt_gas: bool, **kwargs: Any) -> torch.Tensor:
        steps = self.config.gradient_accumulation_steps
        if self.deterministic and not scale_wrt_gas:
            raise deterministic.refusal("engine.backward(scale_wrt_gas=False)", "Call engine.backward(loss).")
        faults.where.step = self.global_steps
        before = self.accumulation.backward_count
        (loss if scale_wrt_gas or steps == 1 else loss * steps).backward(retain_graph=retain_graph, **kwargs)
        if self.accumulation.backward_count == before:
            # Nothing in the model took part (no hook fired): still run the epilogue, so this
            # rank issues the same collectives as ranks whose loss did reach the model.
            self._grads.run_epilogue()
        returned = loss / steps if scale_wrt_gas else loss
        self.training_figures.note_loss(returned)  # monitoring: the step's train_loss
        return returned

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Backward calls inside keep their gradients local (no communication)."""
        if self.deterministic:
            raise deterministic.refusal("engine.no_sync()", "Drop the no_sync() block.")
        return self.accumulation.no_sync()

    def is_gradient_accumulation_boundary(self) -> bool:
        return self.accumulation.is_boundary()

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        if not self.config.managed_gradient_accumulation:
            raise RuntimeError(
                "set_gradient_accumulation_boundary(): with managed_gradient_accumulation false, every "
                "engine.step() is the boundary. Call step() when the accumulation ends, or set "
                "managed_gradient_accumulation to true."
            )
        if self.deterministic:
            deterministic.check_boundary(self, is_boundary)
        self.accumulation.override_boundary(is_boundary)

    # ------------------------------------------------------------------- step
    def step(self) -> None:
        """The optimizer step, at the accumulation boundary only (with
        managed_gradient_accumulation false, every step() is the boundary).

        A second call for the same step (no backward since the last `step()`) changes
        nothing: no optimizer step, no counter moves, so Adam's bias correction is what one
        call gives. Every rank counts the same backwards (a rank whose loss missed the model
        still runs the backward epilogue in `engine.backward`), so they agree on it.
        """
        steps_before = self.global_steps
        with call(self, "step"):
            with self.timers.span("step"), self.memory_guard.phase("optimizer step"):
                self._step_once()
            if self.global_steps != steps_before:
                self.figures.after_step(self)
                if self.monitor.enabled and self.global_steps % self.config.steps_per_print == 0:
                    # The interval's timers, FLOPs, collectives and MoE figures go to the monitors
                    # with DeepSpeed's names (Train/Samples/elapsed_time_ms_*, ...).
                    self.monitor.write_events(self.figures.monitor_events(self.global_samples))
                self.preemption.after_step()  # the ranks agreed to stop: save together and exit

    def _step_once(self) -> None:
        state = self.accumulation
        if not state.begin_step():
            return
        try:
            if state.is_boundary():
                self._boundary_step()
        finally:
            state.end_step()
        state.micro_step_done()

    def _boundary_step(self) -> None:
        if self.optimizer is None:
            raise RuntimeError("engine.step(): no optimizer. Set 'optimizer' in the config or pass optimizer=.")
        state = self.accumulation
        self._grads.flush()
        if self._grads.params is not None:
            # A unit pinned by a forward no backward followed would keep stale values
            # after the update (zeroshard/sharding/schedule.py's [Note: pinned units]).
            self._grads.params.free_all()
        faults.where.step = self.global_steps
        position = (self.global_steps, state.take_training_forwards())
        # Applies .grad changed in place through the views (stages 0-1, zeroshard/grads/views.py).
        result = self._step.run(self._grads.reducer.take_local_sum(), position)
        self._grads.views.clear()
        self._global_grad_norm = result.norm_tensor
        self._post_clip_grad_norm = result.post_clip_tensor
        state.optimizer_ran(overflow=result.overflow)
        if not result.finite:
            self._log_nonfinite(result)
        if self._load_balancer is not None:  # AutoEP's selection bias, once per step
            self._load_balancer.step(state.step_applied)
        self._log_step(result)
        per_backward = self.config.train_micro_batch_size_per_gpu * self.world_size
        samples_before = state.global_samples
        state.boundary_step_done(state.samples_since_last_step(self.config.train_batch_size, per_backward))
        # ---- monitoring (zeroshard/monitor): DeepSpeed's events, the figures of metrics()
        self.training_figures.after_step(
            self.global_steps, samples_before, state.global_samples, self.get_lr(), self.loss_scale,
            self._global_grad_norm,
        )

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
    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest: bool = True, *, async_save=None):
        """Write this rank's shards and the shared index under save_dir/tag (atomic); with
        `async_save` (None: `checkpoint.writer.decoupled`) the files are written in the background."""
        from zeroshard import checkpoint

        with call(self, "save"), self.memory_guard.phase("save"):
            return checkpoint.save_checkpoint(self, save_dir, tag, client_state, save_latest, async_save=async_save)

    def wait_for_checkpoint(self) -> None:
        """Wait for an asynchronous save to be written and published; collective."""
        from zeroshard import checkpoint

        with call(self, "save"):
            checkpoint.wait_for_checkpoint("engine.wait_for_checkpoint()")

    def load_checkpoint(
        self, load_dir, tag=None, load_module_strict: bool = True, load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True, load_module_only: bool = False, custom_load_fn=None,
        allow_pickle: bool = False,
    ):
        """Load a checkpoint saved on any world size and stage; returns (path, client_state).
        DeepSpeed's signature; module keys always match strictly (a mismatch is an error that
        lists them, whatever `load_module_strict`), and `custom_load_fn` is refused."""
        from zeroshard import checkpoint

        if custom_load_fn is not None:
            raise ValueError("load_checkpoint(custom_load_fn=...): not supported by zeroshard. Load without it.")

        with call(self, "load"), self.memory_guard.phase("load"):
            return checkpoint.load_checkpoint(
                self, load_dir, tag, load_optimizer_states=load_optimizer_states,
                load_lr_scheduler_states=load_lr_scheduler_states, load_module_only=load_module_only,
                allow_pickle=allow_pickle,
            )

    def resume_latest(self, load_dir=None, **load_options):
        """Load the newest complete checkpoint in load_dir (default: preemption.save_dir) at this
        world size and stage; (None, None) if there is none. Collective (checkpoint/resume.py)."""
        from zeroshard.checkpoint.resume import resume_latest

        load_dir = load_dir if load_dir is not None else self.config.preemption.save_dir
        if load_dir is None:
            raise ValueError("resume_latest(): pass the directory, or set preemption.save_dir in the config.")
        with call(self, "load"):
            return resume_latest(self, load_dir, **load_options)

    def should_stop(self) -> bool:
        """Whether a rank was asked to stop (a scheduler's signal); collective: call it on every
        rank at the same point of the loop (checkpoint/preempt.py)."""
        return self.preemption.should_stop()

    def save_16bit_model(
        self, save_dir, save_filename: str = "pytorch_model.safetensors", exclude_frozen_parameters: bool = False
    ):
        """The consolidated module weights in the parameter dtype, for inference (rank 0 writes)."""
        from zeroshard import checkpoint

        with call(self, "save"):
            return checkpoint.save_16bit_model(self, save_dir, save_filename, exclude_frozen_parameters)

    # -------------------------------------------------------------- accessors
    def metrics(self) -> dict[str, Any]:
        """The latest step's figures as plain numbers: loss (the mean of the step's
        `engine.backward` losses on this rank), lr (first group), loss_scale, grad_norm (before
        clipping), samples, step, and `name/key` for each producer given to
        `engine.training_figures.register(name, fn)`. Reading it waits for the device (the step does not)."""
        return self.training_figures.metrics()

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
        return (self.layout.data or self.layout.tensor_data or self.layout.world).handle

    @property
    def dp_world_size(self) -> int:
        """DeepSpeed's name: ranks that see different samples."""
        return self.data_parallel_size

    @property
    def data_parallel_rank(self) -> int:
        """This rank's index among the ranks that see different samples."""
        return (self.layout.data or self.layout.tensor_data or self.layout.world).rank

    @property
    def mp_world_size(self) -> int:
        """DeepSpeed's name: the tensor-parallel size (1 without AutoTP)."""
        return self.layout.tensor_parallel_size

    def autotp_size(self) -> int:
        """`tensor_parallel.autotp_size` (DeepSpeed's engine method; 0 when off, as written)."""
        return self.config.tensor_parallel.autotp_size

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
