"""The two engines `zeroshard simulate` runs on one model and one simulated group: zeroshard's,
and torch's FSDP2 (`fully_shard` on each of the units zeroshard would make, then on the root).

Each runner builds the model itself, so that only this rank's shard is ever allocated where
the engine allows it: zeroshard at stage 3 builds under `zeroshard.zero.Init` (one module's
full parameters at a time, then its part), FSDP2 builds on the meta device, shards, then
allocates the shards (`to_empty`) and initialises them. Both answer:
`micro_step(tokens, boundary)` (forward and backward; the optimizer step at the boundary),
`model_state_bytes()` (bytes held per role, counted between the last backward and the step) and
`collectives()` (what one step sent: zeroshard's from its recorder, FSDP2's from the simulated
backend's log, in the same units).
"""

from __future__ import annotations

import contextlib
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from zeroshard.comm import collectives as comm
from zeroshard.comm import simulated
from zeroshard.models import batch_for

__all__ = ["ZeroshardRunner", "FSDP2Runner", "ROLES", "count_engine_states"]

ROLES = ("params", "gradients", "master_weights", "optimizer_state")


def _loss_of(output: Any) -> torch.Tensor:
    if isinstance(output, tuple):
        return output[1]
    return output.loss


def _storage_bytes(tensors, seen: set[int]) -> int:
    """Bytes of the distinct storages of `tensors` not in `seen` (views of one buffer count once)."""
    total = 0
    for t in tensors:
        if t is None or t.device.type == "meta":
            continue
        storage = t.untyped_storage()
        if storage.nbytes() and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def count_engine_states(engine: Any) -> dict[str, int]:
    """Bytes a zeroshard engine holds per model-state role on this rank: parameters (full
    buffers while materialised, stage-3 parameter shards), gradients (local and reduced
    buffers), master weights (when not the parameters themselves) and optimizer state."""
    seen: set[int] = set()
    params = _storage_bytes([t for flat in engine.flats for t in (flat.full, flat.param_shard)], seen)
    grads = _storage_bytes([t for flat in engine.flats for t in (flat.grads.local, flat.grads.reduced)], seen)
    masters = _storage_bytes([flat.master for flat in engine.flats], seen)
    state = _storage_bytes(_optimizer_tensors(engine.optimizer), seen)
    return {"params": params, "gradients": grads, "master_weights": masters, "optimizer_state": state}


def _optimizer_tensors(optimizer: Any) -> list[torch.Tensor]:
    inner = getattr(optimizer, "optimizer", optimizer)
    found = []
    for per_param in getattr(inner, "state", {}).values():
        for value in per_param.values():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                found.append(value)
    return found


class _Runner:
    """What both runners share: the batch, the step counter, collectives by kind."""

    engine_name = ""

    def __init__(self, raw_config: dict, build: Callable[[], nn.Module], device: torch.device) -> None:
        self.raw_config = raw_config
        self.device = device
        self.states: dict[str, int] | None = None

    def model_state_bytes(self) -> dict[str, int]:
        assert self.states is not None, "model states are counted during the first boundary step"
        return {**self.states, "total": sum(self.states.values())}

    @contextlib.contextmanager
    def recording(self) -> Iterator[Callable[[], list[dict]]]:
        raise NotImplementedError


def summarize(entries: list[tuple[str, int, torch.dtype | None, int, str]]) -> list[dict]:
    """[(op, group size, dtype, bytes, via)] -> one row per distinct collective with its count;
    `via` (the collective that carried it out, e.g. gloo's reduce-scatter as an all-reduce) only
    where there is one."""
    counts = Counter(entries)
    rows = []
    for (op, size, dtype, nbytes, via), count in sorted(counts.items(), key=lambda kv: (kv[0][0], -kv[0][3])):
        row = {"op": op, "group_size": size, "dtype": str(dtype).removeprefix("torch.") if dtype else None,
               "bytes": nbytes, "count": count}
        if via:
            row["via"] = via
        rows.append(row)
    return rows


class ZeroshardRunner(_Runner):
    """zeroshard's engine from the config, as `zeroshard.initialize` builds it."""

    engine_name = "zeroshard"

    def __init__(
        self, raw_config: dict, build: Callable[[], nn.Module], device: torch.device, stage: int, zero_init: bool = True
    ) -> None:
        from zeroshard.engine.initialize import initialize
        from zeroshard.zero import Init

        super().__init__(raw_config, build, device)
        use_init = stage == 3 and zero_init
        init = Init(config_dict_or_path=raw_config) if use_init else contextlib.nullcontext()
        with device, init:
            model = build()
        self.engine, *_ = initialize(model=model, model_parameters=model.parameters(), config=raw_config)

    @property
    def module(self) -> nn.Module:
        return self.engine.module

    def micro_step(self, tokens: torch.Tensor, boundary: bool, count_states: bool = False) -> torch.Tensor:
        args, kwargs = batch_for(self.engine.module, tokens)
        loss = _loss_of(self.engine(*args, **kwargs))
        group = getattr(self.engine.module, "sequence_group", None)
        if group is not None:  # Ulysses: the mean over the whole sequence (docs/sequence-parallel.md)
            from zeroshard.sequence.loss import token_weighted_loss

            loss = token_weighted_loss(loss * tokens.numel(), tokens.numel(), group)
        self.engine.backward(loss)
        if count_states and boundary:
            self.states = count_engine_states(self.engine)
        self.engine.step()
        return loss.detach()

    @contextlib.contextmanager
    def recording(self) -> Iterator[Callable[[], list[dict]]]:
        with comm.recording() as log:
            yield lambda: summarize([(r.op, len(r.group), r.dtype, r.bytes, r.via) for r in log.records])


class FSDP2Runner(_Runner):
    """torch FSDP2 on the same model: `fully_shard` on each unit zeroshard would make (the
    repeated blocks, by zeroshard's own unit rule) and on the root, `reshard_after_forward` at
    stage 3 only (below, FSDP2's ZeRO-2-like setting); the config's precision as
    FSDP2's users write it (bf16: MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32),
    fp32 masters; torch_autocast: autocast around forward); torch AdamW with the config's
    parameters; clip_grad_norm_ with the config's gradient_clipping."""

    engine_name = "fsdp2"

    def __init__(self, raw_config: dict, build: Callable[[], nn.Module], device: torch.device, resolved: Any) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        from zeroshard.sharding.units import plan_units

        super().__init__(raw_config, build, device)
        self.resolved = resolved
        if resolved.sequence_parallel_size > 1:
            raise ValueError(
                f"sequence_parallel_size={resolved.sequence_parallel_size}: the FSDP2 comparison runs data "
                "parallelism only. Compare with sequence_parallel_size 1."
            )
        if resolved.fp16.enabled:
            raise ValueError(
                "fp16.enabled: FSDP2 has no fp16 recipe here (fp16 parameters need fp32 masters and a loss "
                "scaler, which FSDP2 leaves to the user). Compare in bf16 or fp32."
            )
        self.autocast = bool(resolved.torch_autocast.enabled)
        policy = MixedPrecisionPolicy()
        if resolved.bf16.enabled:
            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        with torch.device("meta"):
            model = build()
        mesh = init_device_mesh(device.type, (torch.distributed.get_world_size(),))  # simulated or real
        extras = resolved.zeroshard
        # Stage 3 frees each block's parameters after its forward; below, they stay gathered
        # from forward to backward (FSDP2's ZeRO-2-like setting).
        reshard = resolved.zero_optimization.stage == 3
        for unit in plan_units(model, extras.unit_module_classes, extras.unit_min_params)[1:]:
            fully_shard(unit.module, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard)
        fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard)
        model.to_empty(device=device)
        with warnings.catch_warnings():
            # DTensor's random ops warn that a CPU mesh may draw differently on each rank: values
            # here only need to be finite (every peer is this rank anyway).
            warnings.filterwarnings("ignore", message="DTensor random operators")
            _initialise(model)
        self.model = model
        self.optimizer = _torch_optimizer(raw_config, model, device)
        self.clip = resolved.gradient_clipping

    @property
    def module(self) -> nn.Module:
        return self.model

    def micro_step(self, tokens: torch.Tensor, boundary: bool, count_states: bool = False) -> torch.Tensor:
        self.model.set_requires_gradient_sync(boundary)
        args, kwargs = batch_for(self.model, tokens)
        context = torch.autocast(self.device.type, dtype=torch.bfloat16) if self.autocast else contextlib.nullcontext()
        with context:
            loss = _loss_of(self.model(*args, **kwargs))
        (loss / self.resolved.gradient_accumulation_steps).backward()
        if boundary:
            if self.clip:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
            if count_states:
                self.states = self._count()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    def _count(self) -> dict[str, int]:
        seen: set[int] = set()
        params = [p.to_local() if hasattr(p, "to_local") else p for p in self.model.parameters()]
        grads = [g.to_local() if hasattr(g, "to_local") else g for g in (p.grad for p in self.model.parameters())]
        return {
            "params": _storage_bytes(params, seen),
            "gradients": _storage_bytes(grads, seen),
            "master_weights": 0,  # the sharded fp32 parameters are FSDP2's masters
            "optimizer_state": _storage_bytes(
                [t.to_local() if hasattr(t, "to_local") else t for t in _optimizer_tensors(self.optimizer)], seen
            ),
        }

    @contextlib.contextmanager
    def recording(self) -> Iterator[Callable[[], list[dict]]]:
        sim = simulated.current()
        before, sim.log = sim.log, []
        try:
            log = sim.log
            yield lambda: summarize([(c.kind, c.group_size, c.dtype, c.nbytes, "") for c in log])
        finally:
            sim.log = before


def _initialise(model: nn.Module) -> None:
    """Fresh values for a model whose storage `to_empty` allocated: its own initialiser
    (the GPT's and the Llama's `_init_weights`, a Hugging Face model's `init_weights`)."""
    with torch.no_grad():
        if hasattr(model, "_init_weights") and not hasattr(model, "init_weights"):
            model._init_weights()
        elif hasattr(model, "init_weights"):
            model.init_weights()
        for module in model.modules():  # norms: ones and zeros as constructed
            if isinstance(module, (nn.LayerNorm, nn.RMSNorm)) and module.weight is not None:
                module.weight.fill_(1.0)
                if getattr(module, "bias", None) is not None:
                    module.bias.zero_()


def _torch_optimizer(raw: dict, model: nn.Module, device: torch.device) -> torch.optim.Optimizer:
    section = raw.get("optimizer") or {"type": "AdamW", "params": {}}
    kind = str(section.get("type", "AdamW")).lower()
    params = dict(section.get("params") or {})
    if kind not in ("adam", "adamw"):
        raise ValueError(
            f"optimizer.type={section.get('type')!r}: the FSDP2 comparison runs torch's AdamW only. "
            "Compare with an Adam/AdamW config."
        )
    kwargs = {k: params[k] for k in ("lr", "betas", "eps", "weight_decay") if k in params}
    if "betas" in kwargs:
        kwargs["betas"] = tuple(kwargs["betas"])
    cls = torch.optim.AdamW if kind == "adamw" or params.get("adam_w_mode", False) else torch.optim.Adam
    return cls(model.parameters(), **kwargs, foreach=True)
