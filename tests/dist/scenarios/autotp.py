"""AutoTP with ZeRO on gloo (tests/dist/autotp/test_autotp.py; the wide grid is
benchmarks/autotp_conformance.py): tiny Hugging Face Llama (grouped-query attention) and Qwen3
split over tensor groups of 2, ZeRO stages 0-3 over the data-parallel ranks, against a
single-process reference that applies the same casts by hand.

Data: step s, micro-step m, data-parallel rank r trains on `batch(s, m, r)` (2 sequences);
the reference's global batch is the data-parallel ranks' batches side by side, and the
gradient is their mean (fp32 accumulation, as zeroshard's default in every mode).
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
import torch.distributed as dist

from tests.unit.autotp.models import build

MICRO = 2  # sequences per data-parallel rank and micro-step
SEQ = 8
LR = 1e-2
# AdamW divides by sqrt(v) + eps: with torch's 1e-8 a component whose gradient is near 1e-8 moves
# by up to LR for a float32 rounding of it (measured 1.4e-5 on the weights); 1e-6 keeps the weight
# comparison about the split, not about that amplification.
EPS = 1e-6
CLIP = 1.0


def batch(step: int, micro: int, dp_rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + dp_rank)
    return torch.randint(0, 64, (MICRO, SEQ), generator=g)


def global_batch(step: int, micro: int, dp: int) -> torch.Tensor:
    return torch.cat([batch(step, micro, r) for r in range(dp)])


OFFLOAD = {"": {}, "optimizer": {"offload_optimizer": {"device": "cpu"}},
           "param": {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}}


def config(stage: int, precision: str, tp: int, gas: int, micro: int = MICRO, offload: str = "",
           **extra: Any) -> dict[str, Any]:
    """`offload`: "" none, "optimizer" (masters and AdamW state on the host), "param" (stage 3:
    the parameters' shards on the host as well)."""
    cfg = {
        "train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "eps": EPS, "weight_decay": 0.0}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0, **OFFLOAD[offload]},
        "gradient_clipping": CLIP, "steps_per_print": 10**6,
        "tensor_parallel": {"autotp_size": tp},
        **extra,
    }
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


# ---------------------------------------------------------------------------------- reference


def reference(kind: str, precision: str, steps: int, dp: int, gas: int) -> dict[str, Any]:
    """One process, no tensor parallelism: per step the loss (mean over the global batch), the
    pre-clip gradient norm, and the fp32 weights after every step. bf16: the model computes in
    bf16 (its parameters are the fp32 masters cast), each data-parallel rank's micro-batch on
    its own as the engine does, gradients summed in fp32 and averaged."""
    model = build(kind)
    masters = {n: p.detach().clone().float() for n, p in model.named_parameters()}
    if precision == "bf16":
        model.to(torch.bfloat16)
    params = dict(model.named_parameters())
    master_list = [torch.nn.Parameter(masters[n]) for n in params]
    optimizer = torch.optim.AdamW(master_list, lr=LR, eps=EPS, weight_decay=0.0)
    losses, norms, weights = [], [], []
    for step in range(steps):
        grads = [torch.zeros_like(m) for m in master_list]
        total = 0.0
        for micro in range(gas):
            for r in range(dp):
                ids = batch(step, micro, r)
                model.zero_grad(set_to_none=True)
                loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
                total += float(loss.detach()) / (dp * gas)
                for g, p in zip(grads, params.values(), strict=True):
                    g += p.grad.float()
        for g, m in zip(grads, master_list, strict=True):
            m.grad = g / (dp * gas)
        norms.append(float(torch.nn.utils.clip_grad_norm_(master_list, CLIP)))
        optimizer.step()
        with torch.no_grad():
            for m, p in zip(master_list, params.values(), strict=True):
                p.copy_(m)
        losses.append(total)
        weights.append({n: m.detach().clone() for n, m in zip(params, master_list, strict=True)})
    return {"losses": losses, "norms": norms, "weights": weights}


def _references(keys: list[tuple], steps: int, dp: int, gas: int) -> dict[tuple, dict[str, Any]]:
    """Every reference run, each computed by one rank (round robin) and shared."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = {key: reference(*key, steps=steps, dp=dp, gas=gas) for i, key in enumerate(keys) if i % world == rank}
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, mine)
    out: dict[tuple, dict[str, Any]] = {}
    for part in gathered:
        out.update(part)
    return out


# ----------------------------------------------------------------------------------- engines


def _global_loss(loss: torch.Tensor, engine: Any) -> float:
    """The loss over the global batch: the mean of the data-parallel ranks' (tensor ranks agree)."""
    value = loss.detach().float().clone()
    if engine.dp_world_size > 1:
        dist.all_reduce(value, group=engine.data_parallel_group)
    return float(value) / engine.dp_world_size


def _weight_error(engine: Any, want: dict[str, torch.Tensor]) -> float:
    """Max |this rank's piece (or whole parameter) - the reference's| over every parameter."""
    from zeroshard.autotp.split import tensor_split_of
    from zeroshard.zero import GatheredParameters

    worst = 0.0
    params = dict(engine.module.named_parameters())
    with GatheredParameters(list(params.values())):
        for name, p in params.items():
            split = tensor_split_of(p)
            ref = want[name] if split is None else split.piece_of(want[name])
            worst = max(worst, float((p.detach().float() - ref).abs().max()))
    return worst


def train(kind: str, precision: str, stage: int, steps: int, gas: int, tp: int = 2, record: bool = False,
          save_dir: str | None = None, save_after: int | None = None,
          offload: str = "") -> tuple[Any, dict[str, Any]]:
    """A zeroshard engine over the world: per-step global losses and norms, timings, and (with
    `record`) the collectives of the first micro-step by tag."""
    import zeroshard
    from zeroshard.comm import recording

    model = build(kind)
    start = time.perf_counter()
    engine, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(),
                                      config=config(stage, precision, tp, gas, offload=offload))
    dp_rank = engine.data_parallel_rank
    out: dict[str, Any] = {"losses": [], "norms": [], "init_s": time.perf_counter() - start}
    for step in range(steps):
        total = 0.0
        for micro in range(gas):
            ids = batch(step, micro, dp_rank)
            if record and step == 0 and micro == 0:
                with recording() as log:
                    loss = engine(input_ids=ids, labels=ids).loss
                    forward = len(log.records)
                    engine.backward(loss)
                out["collectives"] = [(r.tag, r.op, r.group, i < forward) for i, r in enumerate(log.records)]
            else:
                loss = engine(input_ids=ids, labels=ids).loss
                engine.backward(loss)
            engine.step()
            total += _global_loss(loss, engine) / gas
        out["losses"].append(total)
        out["norms"].append(engine.get_global_grad_norm())
        if save_dir is not None and step + 1 == save_after:
            engine.save_checkpoint(save_dir, tag="tp")
    out["train_s"] = time.perf_counter() - start - out["init_s"]
    return engine, out


def resume(kind: str, save_dir: str, stage: int, tp: int, step: int, want: dict[str, Any], gas: int) -> dict[str, Any]:
    """Load the tp 2 x dp 2 checkpoint at another layout (world / tp data-parallel ranks), train
    step `step` on the same global batch, compare with the uninterrupted reference."""
    import zeroshard

    world = dist.get_world_size()
    dp = world // tp
    micro = MICRO * 2 // dp  # the saving run's global batch, cut over this run's data ranks
    model = build(kind, seed=1)  # other weights: everything must come from the checkpoint
    # With tensor parallelism a memory budget is not checked (zeroshard/memory/guard.py): the
    # prediction does not lay out pieces sharded over the data group.
    budget = {"zeroshard": {"memory_budget_gb": 64}} if tp > 1 else {}
    engine, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(),
                                      config=config(stage, "fp32", tp, gas, micro=micro, **budget))
    engine.load_checkpoint(save_dir, tag="tp")
    loaded = _weight_error(engine, want["weights"][step - 1])
    rank = engine.data_parallel_rank
    total = 0.0
    for m in range(gas):
        ids = global_batch(step, m, 2)[rank * micro : (rank + 1) * micro]
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        total += _global_loss(loss, engine) / gas
    return {"loaded_error": loaded, "loss": total, "norm": engine.get_global_grad_norm(),
            "after_error": _weight_error(engine, want["weights"][step]), "tp": engine.mp_world_size,
            "dp": engine.dp_world_size, "step": engine.global_steps,
            "memory_check": (engine.memory_guard.on, engine.memory_guard.source)}


def input_check() -> str:
    """Different samples on the two ranks of a tensor group: the first forward refuses on both."""
    import zeroshard
    from zeroshard.autotp.input_check import TensorParallelInputError

    model = build("llama")
    engine, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(),
                                      config=config(0, "fp32", 2, 1))
    ids = batch(0, 0, dist.get_rank())  # per global rank: tensor peers differ
    try:
        engine(input_ids=ids, labels=ids)
    except TensorParallelInputError as error:
        return str(error)
    return "no error"


def export(engine: Any, kind: str, out_dir: str) -> dict[str, Any] | None:
    """The 16-bit state dict (pieces gathered over the tensor group) written with Hugging Face's
    save_pretrained by rank 0 and read back by from_pretrained; None on the other ranks."""
    state = engine._consolidated_16bit_state_dict()
    if dist.get_rank() != 0:
        return None
    exported = {k: v.float().clone() for k, v in state.items()}  # save_pretrained empties the dict it is given
    model = build(kind)
    model.save_pretrained(out_dir, state_dict=state)
    loaded = type(model).from_pretrained(out_dir)
    return {"state": exported,
            "loaded": {k: v.detach().float().clone() for k, v in loaded.state_dict().items()}}


# -------------------------------------------------------------------------------------- tasks


def scenario(workdir: str, cases: list[tuple[str, str, int, str]], steps: int = 2, gas: int = 2) -> dict[str, Any]:
    """World 4 (tp 2 x dp 2): every (kind, precision, stage, offload) of `cases` against its
    reference; the collectives of one step; a checkpoint of the llama fp32 stage-2 run resumed at
    tp 1 x dp 4 (stage 3); the 16-bit export; the input check."""
    cpu = time.process_time()
    refs = _references(sorted({(k, p) for k, p, _, _ in cases}), steps + 1, dp=2, gas=gas)
    out: dict[str, Any] = {"cases": {}}
    for kind, precision, stage, offload in cases:
        resume_case = (kind, precision, stage, offload) == ("llama", "fp32", 2, "")
        record = stage == 0
        engine, got = train(kind, precision, stage, steps + 1 if resume_case else steps, gas, record=record,
                            save_dir=os.path.join(workdir, "ckpt") if resume_case else None, save_after=steps,
                            offload=offload)
        ref = refs[(kind, precision)]
        got["weight_error"] = _weight_error(engine, ref["weights"][len(got["losses"]) - 1])
        got["reference"] = {"losses": ref["losses"][: len(got["losses"])], "norms": ref["norms"][: len(got["norms"])]}
        if (kind, precision, stage, offload) == ("llama", "fp32", 3, ""):
            got["export"] = export(engine, kind, os.path.join(workdir, "export"))
            got["export_reference"] = ref["weights"][len(got["losses"]) - 1] if dist.get_rank() == 0 else None
        if resume_case and dist.get_rank() == 0:  # what the checkpoint holds: for `zeroshard to-fp32`
            got["checkpoint_reference"] = ref["weights"][steps - 1]
        out["cases"][(kind, precision, stage, offload)] = got
    out["resume_tp1_dp4"] = resume("llama", os.path.join(workdir, "ckpt"), 3, 1, steps, refs[("llama", "fp32")], gas)
    out["input_check"] = input_check()
    out["cpu_s"] = time.process_time() - cpu  # this rank's CPU time: the suite's cost on idle cores
    return out


def resume_tp2_dp1(workdir: str, steps: int = 2, gas: int = 2) -> dict[str, Any]:
    """World 2 (tp 2 x dp 1): the world-4 run's checkpoint resumed at stage 1."""
    ref = _references([("llama", "fp32")], steps + 1, dp=2, gas=gas)[("llama", "fp32")]
    return resume("llama", os.path.join(workdir, "ckpt"), 1, 2, steps, ref, gas)


def run_example(example: str, config: str, steps: int = 3) -> str:
    """An example (a path from the repository root) as torchrun would run it with
    `--deepspeed_config config` (the pool sets torchrun's environment); what it printed."""
    import contextlib
    import io
    import runpy
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    argv = sys.argv
    sys.argv = [str(root / example), "--deepspeed_config", str(root / config), "--steps", str(steps)]
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            runpy.run_path(sys.argv[0], run_name="__main__")
    finally:
        sys.argv = argv
    return printed.getvalue()


def resume_deepspeed_autotp() -> dict[str, Any]:
    """World 2 (tp 2 x dp 1): DeepSpeed 0.19.8's own AutoTP checkpoint (tests/fixtures/deepspeed/
    tp2_s1_fp32_w2) loaded by a zeroshard AutoTP engine at the same layout: this rank's pieces
    right after the load and after DeepSpeed's M_STEPS, against what DeepSpeed read on the same
    tensor rank (the whole tensors the conversion writes are cut into pieces again on load)."""
    import importlib.util
    from pathlib import Path

    import zeroshard
    from zeroshard.zero.full_tensors import safe_get_full_fp32_param, safe_get_full_optimizer_state

    fixtures = Path(__file__).resolve().parents[2] / "fixtures" / "deepspeed"
    spec = importlib.util.spec_from_file_location("ds_autotp_side", fixtures / "autotp_side.py")
    side = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(side)
    case = "tp2_s1_fp32_w2"
    model = build("llama", seed=3)
    engine, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=side.ds_config(case))
    engine.load_checkpoint(str(fixtures / case / "ckpt"))
    want = torch.load(fixtures / case / "expected_ds.pt", weights_only=True)
    tp_rank = engine.layout.tensor.rank

    def error(snapshot: dict) -> float:
        worst = 0.0
        for name, p in engine.module.named_parameters():
            worst = max(worst, float((safe_get_full_fp32_param(p) - snapshot["fp32"][name]).abs().max()))
            for key in ("exp_avg", "exp_avg_sq"):
                got = safe_get_full_optimizer_state(p, key)
                worst = max(worst, float((got - snapshot[key][name]).abs().max()))
        return worst

    loaded = error(want["at_save"][tp_rank])
    for step in range(side.K_STEPS, side.K_STEPS + side.M_STEPS):
        ids = side.batch(step, 0)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
    return {"loaded_error": loaded, "after_error": error(want["after"][tp_rank])}


def benchmark_cell() -> dict[str, Any]:
    """One cell of benchmarks/autotp_conformance.py's grid (Llama fp32, stage 3, accumulation 2,
    tp 2 x dp 1) through the benchmark's own code, which the GPU check runs; and the unsplit
    model's parameter count."""
    from benchmarks.autotp_conformance import grid_rows

    return {"rows": grid_rows(["llama"], ["fp32"], [3], [2], steps=2, tp=2, baseline=False),
            "whole_params": sum(p.numel() for p in build("llama").parameters())}


def world2(workdir: str) -> dict[str, Any]:
    """Everything the world-2 pool runs: the world-4 checkpoint resumed at tp 2 x dp 1,
    DeepSpeed's own AutoTP checkpoint resumed at its layout, and the benchmark's cell."""
    return {"resume": resume_tp2_dp1(workdir), "deepspeed": resume_deepspeed_autotp(), "benchmark": benchmark_cell()}
