"""One runner per engine: the same training step (forward, backward, clip, AdamW) set up the way
each engine's users write it.

A runner answers four things: `train_step(x, y, after_backward=None)` (returns the local loss and
the seconds spent in forward, backward and step; calls `after_backward()` between backward and
step), `model_states()` (a StorageCounter of what it holds by role),
`recording()` (a context in which its collectives are recorded, or nothing) and
`comm_per_step(log, steps)` (bytes per step by op, and whether they were recorded or are the
theory). `unsupported(engine, mode)` says why a combination is not run.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist
from peers_device import PhaseClock, autocast
from peers_measure import (
    StorageCounter,
    optimizer_state_tensors,
    peer_comm_theory,
    zeroshard_comm_theory,
)
from peers_workload import ADAMW_KWARGS, GRADIENT_CLIPPING, Workload, build_model
from torch import nn

ENGINES = ("floor", "floor-par", "zeroshard", "ddp", "fsdp2", "deepspeed")
CPU = torch.device("cpu")
_LOW = {"bf16": torch.bfloat16, "autocast": torch.bfloat16, "fp16": torch.float16}


def unsupported(engine: str, mode: str) -> str | None:
    """Why `engine` is not run in `mode`, or None when it is."""
    if mode == "fp16" and engine in ("floor", "floor-par", "ddp", "fsdp2"):
        return (
            "no fp16 recipe for torch peers here: fp16 parameters need fp32 masters and a loss "
            "scaler, which DDP/FSDP2 leave to the user (autocast + GradScaler is the autocast mode)"
        )
    return None


def _split_numel(model: nn.Module) -> tuple[int, int]:
    """(parameters outside the blocks, parameters of all blocks); tied weights counted once."""
    blocks = sum(p.numel() for p in model.blocks.parameters())
    return sum(p.numel() for p in model.parameters()) - blocks, blocks


class _TorchRunner:
    """Floor and DDP: a torch module, torch AdamW and torch's clip_grad_norm_."""

    # bf16 mode holds the model itself in bf16 (no master copy): the plain bf16 recipe.
    bf16_model = True
    # On CUDA the floor and DDP use fused AdamW (the fastest plain-PyTorch step there).
    fused_on_cuda = True

    def __init__(self, workload: Workload, mode: str, device: torch.device = CPU) -> None:
        self.mode = mode
        self.device = device
        model = build_model(workload)
        if mode == "bf16" and self.bf16_model:
            model = model.to(torch.bfloat16)  # cast before moving: the device never holds fp32
        model = model.to(device)
        self.numel_root, self.numel_blocks = _split_numel(model)
        self.model = self.wrap(model)
        fused = {"fused": True} if device.type == "cuda" and self.fused_on_cuda else {}
        self.optimizer = torch.optim.AdamW(self.model.parameters(), **ADAMW_KWARGS, **fused)

    def wrap(self, model: nn.Module) -> nn.Module:
        return model

    def train_step(self, x: torch.Tensor, y: torch.Tensor, after_backward=None) -> tuple[torch.Tensor, list[float]]:
        clock = PhaseClock(self.device)
        clock.mark()
        self.optimizer.zero_grad(set_to_none=True)
        with autocast(self.device, self.mode == "autocast"):
            _, loss = self.model(x, y)
        clock.mark()
        loss.backward()
        clock.mark()
        if after_backward is not None:
            after_backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), GRADIENT_CLIPPING)
        self.optimizer.step()
        clock.mark()
        return loss.detach(), clock.seconds()

    def model_states(self) -> StorageCounter:
        counter = StorageCounter()
        params = list(self.model.parameters())
        counter.add("params", params)
        counter.add("gradients", [p.grad for p in params])
        counter.add("optimizer_state", optimizer_state_tensors(self.optimizer))
        return counter

    def recording(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def comm_per_step(self, log: Any, steps: int) -> tuple[dict[str, float], str]:
        return {}, "none (one process)"

    def extra(self) -> dict[str, Any]:
        return {}


class FloorRunner(_TorchRunner):
    """The compute floor: one rank's micro-batch on one process, no communication.

    As "floor-par" the same runs in W processes at once, each on its own rank's micro-batch and
    never talking to the others: the floor under the same CPU sharing as a W-rank run.
    """


class DDPRunner(_TorchRunner):
    """torch DistributedDataParallel; gradients are views into its buckets (no extra copy)."""

    def wrap(self, model: nn.Module) -> nn.Module:
        from torch.nn.parallel import DistributedDataParallel

        device_ids = [self.device.index] if self.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=device_ids, gradient_as_bucket_view=True)

    def comm_per_step(self, log: Any, steps: int) -> tuple[dict[str, float], str]:
        by_op, how = peer_comm_theory("ddp", self.mode, None, None, self.numel_root, self.numel_blocks)
        return by_op, f"theory: {how}"


class FSDP2Runner(_TorchRunner):
    """torch FSDP2: fully_shard on every block, then on the root.

    bf16 mode keeps fp32 sharded parameters (the optimizer's) and computes in bf16 through
    MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32).
    """

    bf16_model = False
    fused_on_cuda = False  # its parameters are DTensors; torch's default (foreach) AdamW

    def __init__(self, workload: Workload, mode: str, reshard: bool, device: torch.device = CPU) -> None:
        self.reshard = reshard
        super().__init__(workload, mode, device)

    def wrap(self, model: nn.Module) -> nn.Module:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh(self.device.type, (dist.get_world_size(),))
        policy = MixedPrecisionPolicy()
        if self.mode == "bf16":
            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=self.reshard, mp_policy=policy)
        fully_shard(model, mesh=mesh, reshard_after_forward=self.reshard, mp_policy=policy)
        return model

    def comm_per_step(self, log: Any, steps: int) -> tuple[dict[str, float], str]:
        by_op, how = peer_comm_theory(
            "fsdp2", self.mode, None, self.reshard, self.numel_root, self.numel_blocks
        )
        return by_op, f"theory: {how}"


def _engine_config(workload: Workload, mode: str, stage: int) -> dict[str, Any]:
    """The DeepSpeed-format config that zeroshard and DeepSpeed both read."""
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": workload.micro_batch,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {**ADAMW_KWARGS, "betas": list(ADAMW_KWARGS["betas"])}},
        "gradient_clipping": GRADIENT_CLIPPING,
        "zero_optimization": {"stage": stage},
        "steps_per_print": 1_000_000,
        "seed": workload.seed,
    }
    if workload.optimizer == "muon":
        cfg["optimizer"] = {"type": "Muon", "params": {
            "muon_lr": 0.02, "adam_lr": ADAMW_KWARGS["lr"], "betas": list(ADAMW_KWARGS["betas"]),
            "weight_decay": ADAMW_KWARGS["weight_decay"]}}
    if mode == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif mode == "fp16":
        cfg["fp16"] = {"enabled": True}
    elif mode == "autocast":
        cfg["torch_autocast"] = {"enabled": True, "dtype": "bfloat16"}
    return cfg


def deepspeed_style_step(engine: Any, x: torch.Tensor, y: torch.Tensor, after_backward=None,
                         device: torch.device = CPU):
    """One step of the DeepSpeed loop (zeroshard and DeepSpeed run the very same code), timed
    as forward / backward / step."""
    clock = PhaseClock(device)
    clock.mark()
    _, loss = engine(x, y)
    clock.mark()
    engine.backward(loss)
    clock.mark()
    if after_backward is not None:
        after_backward()
    engine.step()
    clock.mark()
    return loss.detach(), clock.seconds()


class ZeroshardRunner:
    """zeroshard at one stage, configured from a DeepSpeed-format dict."""

    def __init__(self, workload: Workload, mode: str, stage: int, device: torch.device = CPU) -> None:
        import zeroshard

        self.mode = mode
        self.device = device  # zeroshard picks the same one itself (cuda:LOCAL_RANK)
        self.config = _engine_config(workload, mode, stage)
        model = build_model(workload)
        self.engine, self.optimizer, _, _ = zeroshard.initialize(
            model=model, model_parameters=model.parameters(), config=self.config
        )

    def train_step(self, x: torch.Tensor, y: torch.Tensor, after_backward=None) -> tuple[torch.Tensor, list[float]]:
        return deepspeed_style_step(self.engine, x, y, after_backward, self.device)

    def model_states(self) -> StorageCounter:
        counter = StorageCounter()
        flats = self.engine.flats
        counter.add("params", [f.full for f in flats] + [f.param_shard for f in flats])
        counter.add("master_weights", [f.master for f in flats])
        counter.add("gradients", [f.grads.local for f in flats] + [f.grads.reduced for f in flats])
        counter.add("optimizer_state", optimizer_state_tensors(self.optimizer))
        return counter

    def recording(self) -> contextlib.AbstractContextManager:
        import zeroshard

        return zeroshard.comm.recording()

    def comm_per_step(self, log: Any, steps: int) -> tuple[dict[str, float], str]:
        by_op: dict[str, float] = {}
        for rec in log.records:
            by_op[rec.op] = by_op.get(rec.op, 0.0) + rec.bytes / steps
        return by_op, "recorded (zeroshard.comm.recording)"

    def extra(self) -> dict[str, Any]:
        """zeroshard's own memory estimate and communication theory, to compare with the run."""
        from zeroshard.tools.memory import estimate_for_config

        engine = self.engine
        counts: dict[str, int] = {}
        for flat in engine.flats:
            counts[flat.role.name] = counts.get(flat.role.name, 0) + flat.numel
        units = [u.numel for u in engine.units if u.numel]
        estimate = estimate_for_config(
            engine.config, engine.precision_plan, counts, world_size=engine.world_size, unit_numels=units
        )
        return {
            "estimate_model_state_bytes": estimate.model_state_bytes,
            "estimate_buffer_bytes": estimate.buffer_bytes,
            "comm_theory_bytes_per_step": zeroshard_comm_theory(engine),
        }


class DeepSpeedRunner:
    """DeepSpeed at one stage with the same JSON config (its torch AdamW, gloo on CPU)."""

    def __init__(self, workload: Workload, mode: str, stage: int, device: torch.device = CPU) -> None:
        import deepspeed

        self.mode = mode
        self.device = device
        self.stage = stage
        self.config = _engine_config(workload, mode, stage)
        # DeepSpeed's own AdamW is a compiled op; torch_adam picks torch.optim.AdamW, the same
        # optimizer every other engine here uses (DS_BUILD_OPS=0 builds no ops).
        self.config["optimizer"]["params"]["torch_adam"] = True
        self.config.pop("seed")
        model = build_model(workload)
        self.numel_root, self.numel_blocks = _split_numel(model)
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=self.config
        )

    def train_step(self, x: torch.Tensor, y: torch.Tensor, after_backward=None) -> tuple[torch.Tensor, list[float]]:
        return deepspeed_style_step(self.engine, x, y, after_backward, self.device)

    def model_states(self) -> StorageCounter:
        counter = StorageCounter()
        params = list(self.engine.module.parameters())
        counter.add("params", [getattr(p, "ds_tensor", None) for p in params] + params)
        inner = getattr(self.optimizer, "optimizer", self.optimizer)
        masters = [p for g in inner.param_groups for p in g["params"]]
        counter.add("master_weights", masters)
        counter.add("optimizer_state", optimizer_state_tensors(inner))
        counter.add("gradients", [p.grad for p in params] + [p.grad for p in masters])
        # Flat gradient partitions the ZeRO optimizer keeps on its own, and its buckets.
        counter.add("buffers", _tensors_held_by(self.optimizer, depth=3))
        return counter

    def recording(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def comm_per_step(self, log: Any, steps: int) -> tuple[dict[str, float], str]:
        by_op, how = peer_comm_theory(
            "deepspeed", self.mode, self.stage, None, self.numel_root, self.numel_blocks
        )
        return by_op, f"theory: {how}"

    def extra(self) -> dict[str, Any]:
        return {}


def _tensors_held_by(obj: Any, depth: int, _seen: set[int] | None = None) -> list[torch.Tensor]:
    """Tensors reachable from `obj`'s attributes, lists and dicts, `depth` levels down."""
    seen = _seen if _seen is not None else set()
    if id(obj) in seen or depth < 0 or isinstance(obj, nn.Module):
        return []
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        children = list(obj.values())
    elif isinstance(obj, (list, tuple)):
        children = list(obj)
    elif hasattr(obj, "__dict__") and type(obj).__module__.startswith("deepspeed"):
        children = list(vars(obj).values())
    else:
        return []
    found: list[torch.Tensor] = []
    for child in children:
        found += _tensors_held_by(child, depth - 1, seen)
    return found


def make_runner(engine: str, workload: Workload, mode: str, stage: int | None, reshard: bool | None,
                device: torch.device = CPU):
    """The runner for one (engine, mode, stage/reshard) cell of the benchmark on `device`."""
    if engine in ("floor", "floor-par"):
        return FloorRunner(workload, mode, device)
    if engine == "ddp":
        return DDPRunner(workload, mode, device)
    if engine == "fsdp2":
        return FSDP2Runner(workload, mode, bool(reshard), device)
    if engine == "zeroshard":
        return ZeroshardRunner(workload, mode, int(stage or 0), device)
    if engine == "deepspeed":
        return DeepSpeedRunner(workload, mode, int(stage or 0), device)
    raise ValueError(f"--engine {engine}: use one of {', '.join(ENGINES)}.")
