"""Rank-side scenarios for tests/dist/precision/test_fp8.py and benchmarks/fp8_band.py: the demo
GPT trained with `zeroshard.fp8` (torchao's emulation on CPU) beside the bf16 run.

The batches are byte windows of the standard library's source (the demo's corpus), the same on
every rank and split by rank, so a run at world size W sees W x micro x accumulation windows per
step whatever the stage.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import torch
import torch.distributed as dist

import zeroshard
from zeroshard.demo.data import load_stdlib_corpus
from zeroshard.models.gpt import build_gpt

CORPUS_BYTES = 400_000
FP8 = {"enabled": True, "emulate": True, "min_features": 16}


def gpt_config(stage: int, fp8: bool, micro: int, ga: int, lr: float = 3e-3) -> dict[str, Any]:
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": ga,
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.0}},
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "steps_per_print": 10_000,
    }
    if fp8:
        config["zeroshard"] = {"fp8": dict(FP8)}
    return config


def batches(seed: int, steps: int, rows: int, seq: int) -> list[torch.Tensor]:
    """`steps` global batches of `rows` windows of seq + 1 bytes, drawn with `seed`."""
    corpus = load_stdlib_corpus(CORPUS_BYTES).long()
    g = torch.Generator().manual_seed(1000 + seed)
    starts = torch.randint(0, len(corpus) - seq - 1, (steps, rows), generator=g)
    return [torch.stack([corpus[s : s + seq + 1] for s in row.tolist()]) for row in starts]


def build(stage: int, fp8: bool, seed: int, micro: int, ga: int, preset: str = "tiny", emulate: bool = True,
          recipe: str = "tensorwise", **overrides: Any):
    """The engine of the demo GPT `preset` (GPTConfig `overrides`), bf16 or fp8."""
    torch.manual_seed(seed)
    config = gpt_config(stage, fp8, micro, ga)
    if fp8:
        config["zeroshard"]["fp8"].update(emulate=emulate, recipe=recipe)
    engine, *_ = zeroshard.initialize(model=build_gpt(preset, **overrides), config=config)
    return engine


def train(engine, data: list[torch.Tensor], micro: int, ga: int) -> list[float]:
    """The DeepSpeed loop; per step, the mean loss over every rank's micro-batches."""
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for batch in data:
        total = torch.zeros((), dtype=torch.float64)
        for j in range(ga):
            rows = batch[(j * world + rank) * micro : (j * world + rank + 1) * micro].to(engine.device)
            _, loss = engine(rows[:, :-1], rows[:, 1:])
            engine.backward(loss)
            engine.step()
            total += loss.detach().double()
        dist.all_reduce(total)
        losses.append(float(total) / (ga * world))
    return losses


def masters(engine) -> torch.Tensor:
    """This rank's shard of every fp32 master, concatenated (bitwise comparisons across stages:
    stage 0 keeps the whole master, stages 1-3 the shard)."""
    parts = []
    for flat in engine.flats:
        start, _ = flat.master_range()
        master = flat.master.detach().float().reshape(-1)
        parts.append(master.narrow(0, flat.shard_start - start, flat.shard_numel))
    return torch.cat(parts)


def collectives(log) -> dict[str, list[int]]:
    """'op dtype tag' -> [count, bytes] over the recorded collectives."""
    summary: dict[str, list[int]] = {}
    for record in log.records:
        key = f"{record.op} {str(record.dtype).removeprefix('torch.')} {record.tag}"
        entry = summary.setdefault(key, [0, 0])
        entry[0] += 1
        entry[1] += record.bytes
    return summary


def fp8_numels(engine) -> dict[str, int]:
    """How many flats are gathered in fp8, and their padded elements in all."""
    flats = [flat for flat in engine.flats if flat.fp8 is not None]
    return {"flats": len(flats), "padded": sum(flat.padded_numel for flat in flats)}


def readers(batch: torch.Tensor, micro: int) -> dict[str, Any]:
    """Stage 3: code that reads an fp8 Linear's weight while its unit is gathered in fp8 (the
    placeholder of zeroshard/sharding/fp8_gather.py's note) gets its values: GatheredParameters
    inside the unit's forward, and a use from outside the unit (the root's forward). Each read is
    compared with the master cast to bf16; the forward's loss with the same forward unhooked."""
    from zeroshard import safe_get_full_fp32_param
    from zeroshard.zero import GatheredParameters

    engine = build(3, True, 0, micro, 1)
    model = engine.module
    inside, outside = model.blocks[0].mlp.c_fc.weight, model.blocks[1].mlp.c_proj.weight
    expected = [safe_get_full_fp32_param(w).to(torch.bfloat16) for w in (inside, outside)]
    seen: dict[str, torch.Tensor] = {}

    def in_unit(module, args):
        with GatheredParameters([inside]):
            seen["inside"] = inside.detach().clone()

    def from_root(module, args):
        seen["outside"] = (outside * 1).detach()  # a use from outside block 1

    rows = batch[dist.get_rank() * micro : (dist.get_rank() + 1) * micro]
    with torch.no_grad():
        _, plain = engine(rows[:, :-1], rows[:, 1:])
        handles = [model.blocks[0].mlp.register_forward_pre_hook(in_unit),
                   model.register_forward_pre_hook(from_root)]
        _, hooked = engine(rows[:, :-1], rows[:, 1:])
    for handle in handles:
        handle.remove()
    engine.destroy()
    return {"inside": torch.equal(seen["inside"], expected[0]), "outside": torch.equal(seen["outside"], expected[1]),
            "same_loss": torch.equal(plain, hooked)}


def stages_accumulation_resume(steps: int = 3, micro: int = 2, ga: int = 2, seq: int = 32) -> dict[str, Any]:
    """One pooled task: the fp8 run at stages 0-3 with accumulation, the bf16 run beside it, the
    stage-3 collectives, and a resume at stage 3 (save after step 2, load into a new engine)."""
    world = dist.get_world_size()
    data = batches(0, steps, world * micro * ga, seq)
    out: dict[str, Any] = {"losses": {}, "masters": {}}
    for stage in (0, 1, 2, 3):
        engine = build(stage, True, 0, micro, ga)
        with zeroshard.comm.recording() as log:
            out["losses"][stage] = train(engine, data, micro, ga)
        out["masters"][stage] = masters(engine)
        if stage == 3:
            out["collectives"] = collectives(log)
            out["numels"] = fp8_numels(engine)
            out["fp8_modules"] = list(engine.fp8_modules)
            # Outside the engine's gathers a weight is its (empty) shard, never fp8 bytes.
            out["attribute_left"] = any(hasattr(p, "zeroshard_fp8_gathered") for p in engine.module.parameters())
        engine.destroy()
    engine = build(3, False, 0, micro, ga)
    out["losses"]["bf16"] = train(engine, data, micro, ga)
    engine.destroy()
    out["readers"] = readers(data[0], micro)
    # The rowwise recipe at stage 3: torchao's rowwise casts at every use, bf16 gathers.
    engine = build(3, True, 0, micro, ga, recipe="rowwise")
    with zeroshard.comm.recording() as log:
        out["losses"]["rowwise"] = train(engine, data[:1], micro, ga)
    out["rowwise_collectives"] = collectives(log)
    engine.destroy()

    # Resume: two steps, save, a new engine loads and takes the third step.
    with tempfile.TemporaryDirectory() as scratch:
        where = [scratch]
        dist.broadcast_object_list(where, src=0)  # rank 0's directory, for both ranks
        path = os.path.join(where[0], "ckpt")
        first = build(3, True, 0, micro, ga)
        before = train(first, data[:2], micro, ga)
        first.save_checkpoint(path, tag="two")
        first.destroy()
        second = build(3, True, 7, micro, ga)  # another seed: everything must come from the file
        second.load_checkpoint(path, tag="two")
        after = train(second, data[2:], micro, ga)
        out["resumed"] = {"losses": before + after, "masters": masters(second)}
        second.destroy()
        dist.barrier()  # rank 0 removes the directory when both are done
    return out
