"""Rank-side scenarios for tests/dist/sharding/test_gpu_path.py (stage-3 schedule on gloo)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import zeroshard
from tests.dist.reference import global_batches
from tests.dist.scenarios.common import Case, build_engine, engine_loop_step, full_masters
from zeroshard.comm import collectives as comm


def prefetch_order(prefetch_numel: int) -> dict[str, Any]:
    """Two forwards at stage 3 with `stage3_prefetch_bucket_size = prefetch_numel`; in the
    second (the schedule knows the order from the first), at the end of each block's forward:
    whether the next block's gather was already started, and how many parameter all-gathers
    the recorder saw by then."""
    case = Case(stage=3, micro=2, steps=1, extra={"zero_optimization": {"stage3_prefetch_bucket_size": prefetch_numel}})
    engine = build_engine(case)
    blocks = list(engine.module.blocks)
    unit_of = {id(u.module): u for u in engine.units}
    seen: list[dict[str, Any]] = []
    log_box: dict[str, Any] = {}

    def after_block(index: int):
        def hook(module, args, output):
            if "log" not in log_box or index + 1 >= len(blocks):
                return
            nxt = unit_of[id(blocks[index + 1])]
            started = all(f._pending_gather is not None or f.state.value == "unsharded" for f in nxt.flats)
            gathers = sum(1 for r in log_box["log"].records if r.op == "all_gather" and r.tag == "param")
            seen.append({"block": index, "next_started": started, "gathers": gathers})

        return hook

    for i, block in enumerate(blocks):
        block.register_forward_hook(after_block(i))
    batch = global_batches(case.seed, 1, 2 * case.micro)[0]
    engine_loop_step(engine, case, batch)  # the first forward: the schedule learns the order
    engine.step()
    with comm.recording() as log:
        log_box["log"] = log
        engine_loop_step(engine, case, batch)
    root_flats = len(engine.units[0].flats)
    return {"seen": seen, "root_flats": root_flats, "block_flats": [len(unit_of[id(b)].flats) for b in blocks]}


class BranchBlock(nn.Module):
    """x + tanh(a(x)) + tanh(b(x)) or x + tanh(a(x)), chosen by the sign of the input's mean:
    two ranks given inputs of opposite signs use different parameters of the same unit (`b`
    only on one of them, so its unit completes during backward there and not on the other)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.a = nn.Linear(dim, dim)
        self.b = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x + torch.tanh(self.a(x))
        if bool(x.mean() > 0):
            out = out + torch.tanh(self.b(x))
        return out


class BranchModel(nn.Module):
    def __init__(self, dim: int = 8, blocks: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList(BranchBlock(dim) for _ in range(blocks))
        self.head = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return torch.nn.functional.mse_loss(self.head(h), y)


def _branch_batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank 0's rows are positive, rank 1's negative, so every block uses `b` on rank 0 only."""
    g = torch.Generator().manual_seed(100 + step)
    x = torch.rand(4, 8, generator=g) + 0.5
    y = torch.randn(4, 1, generator=g)
    return (x if rank == 0 else -x), y


def branch_run(stages: tuple[int, ...], steps: int = 3, bucket: int = 64) -> dict[int, Any]:
    """Train BranchModel at each stage with small reduce buckets (so gradient reductions go on
    the wire during backward, between stage 3's all-gathers); the masters after training."""
    out: dict[int, Any] = {}
    for stage in stages:
        torch.manual_seed(0)
        model = BranchModel()
        with torch.no_grad():  # the inputs' sign carries through `inp` into every block
            model.inp.weight.copy_(torch.eye(8))
            model.inp.bias.zero_()
        config = {
            "train_micro_batch_size_per_gpu": 4,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
            "zero_optimization": {
                "stage": stage, "reduce_bucket_size": bucket, "stage3_param_persistence_threshold": 0,
                # Prefetch one unit at a time: the all-gathers go on during backward too.
                "stage3_prefetch_bucket_size": 1,
            },
        }
        engine, _, _, _ = zeroshard.initialize(model=model, config=config)
        losses = []
        for step in range(steps):
            x, y = _branch_batch(step, dist.get_rank())
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))
        out[stage] = {"masters": full_masters(engine), "losses": losses}
    return out


def direct_vs_staged(cases: list[Case]) -> list[dict[str, Any]]:
    """Each case trained twice, reducing straight from the local gradients (a bucket of one
    element: every flat fills a bucket alone) and with every flat staged through a bucket copy;
    the full masters after every step and the losses of both."""
    from tests.dist.scenarios.common import train
    from zeroshard.grads.reduce import GradientReducer

    out = []
    real = GradientReducer._reduce_directly
    for case in cases:
        runs = {}
        for label, allowed in (("direct", True), ("staged", False)):
            calls = {"direct": 0}

            def deciding(self, *args, __allowed=allowed, __calls=calls):
                ok = __allowed and real(self, *args)
                __calls["direct"] += ok
                return ok

            GradientReducer._reduce_directly = deciding
            try:
                engine = build_engine(case)
                result = train(engine, case)
            finally:
                GradientReducer._reduce_directly = real
            runs[label] = {"master": result["master"], "losses": result["losses"], "direct": calls["direct"]}
        out.append(runs)
    return out


class _LinearStack(nn.Module):
    def __init__(self, dim: int = 16, depth: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(dim, dim) for _ in range(depth))
        self.head = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(x).float().pow(2).mean()


def autocast_copies(stage: int) -> dict[str, Any]:
    """One torch_autocast(bf16) forward: the bytes of the autocast casts of parameters that the
    autograd graph saved for backward (they live until backward), beside the estimator's
    `autocast_weight_copies` for this model and world size."""
    from zeroshard.tools.memory import estimate_for_config

    torch.manual_seed(0)
    model = _LinearStack()
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "torch_autocast": {"enabled": True, "dtype": "bfloat16"},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }
    engine, _, _, _ = zeroshard.initialize(model=model, config=config)
    saved: dict[int, int] = {}
    # Full shapes: at stage 3 a parameter outside a gather is empty, `ds_shape` keeps its shape.
    weights_of = [b.weight for b in [*model.blocks, model.head]]
    weight_shapes = {tuple(getattr(w, "ds_shape", w.shape)) for w in weights_of}

    def pack(t: torch.Tensor):
        # A matmul saves its weight's cast as a transposed view of the copy autocast made.
        base = t._base if t._base is not None else t
        cast = base.grad_fn is not None and type(base.grad_fn).__name__ == "ToCopyBackward0"
        if cast and base.dtype == torch.bfloat16 and tuple(base.shape) in weight_shapes:
            saved[base.untyped_storage().data_ptr()] = base.untyped_storage().nbytes()
        return t

    # The input carries a gradient, so the first block's matmul saves its weight too.
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = engine(torch.randn(4, 16, requires_grad=True))
    engine.backward(loss)
    counts: dict[str, int] = {}
    for _name, p in engine.module.named_parameters():
        group = engine._param_group_name[id(p)]
        counts[group] = counts.get(group, 0) + engine.locate(p)[0].numels[engine.locate(p)[1]]
    estimate = estimate_for_config(engine.config, engine.precision_plan, counts, world_size=dist.get_world_size())
    weights = sum(getattr(w, "ds_numel", w.numel()) for w in weights_of)
    return {
        "saved_copy_bytes": sum(saved.values()),
        "weight_bytes_bf16": 2 * weights,
        "estimate": estimate.buffers["autocast_weight_copies"],
        "safe_numel": counts.get("lower_precision_safe", 0),
    }
