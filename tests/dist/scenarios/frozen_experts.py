"""Rank-side scenarios for tests/dist/moe/test_frozen_experts.py: frozen experts (and a frozen
dense layer) through a training step, `save_checkpoint`, `load_checkpoint` and the exports.

The references are independent of the checkpoint code: the DeepSpeed-MoE model's weights are a
function of each parameter's global name (tests/dist/scenarios/moe_engine.py), and the AutoEP
Mixtral's are those of the unswapped Hugging Face model built from the same seed; a frozen
parameter must hold exactly its initial value after a step, after a load and in every export.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

import zeroshard
from tests.dist.scenarios.autoep import batch, build_hf
from tests.dist.scenarios.moe_engine import EngineCase, build_model, engine_config, global_names, micro_batch
from zeroshard.checkpoint.export import consolidate_fp32
from zeroshard.module_inject.auto_ep import autoep_layers

LR = 0.1  # large: a frozen weight that moved would move visibly


def is_frozen_moe_param(name: str) -> bool:
    return ".deepspeed_experts." in name or name.startswith("embed.")


def moe_engine(case: EngineCase, perturb: bool = False, frozen: bool = True):
    """The MoE model with every expert and the embedding frozen (`frozen`; else all trained);
    `perturb`: those weights start at other values (so a load must overwrite them)."""
    model = build_model(case.ep_size)
    for name, p in global_names(model).items():
        if is_frozen_moe_param(name):
            p.requires_grad_(not frozen)
            if perturb:
                with torch.no_grad():
                    p.add_(1.0)
    config = engine_config(case)
    config["optimizer"]["params"]["lr"] = LR
    engine, _, _, _ = zeroshard.initialize(model=model, config=config)
    return engine


def _moe_state(engine) -> dict[str, torch.Tensor]:
    """Frozen parameters as the module holds them, trained ones' fp32 masters (collective),
    keyed by global name."""
    out = {}
    for name, p in global_names(engine.module).items():
        out[name] = p.detach().clone() if not p.requires_grad else zeroshard.safe_get_full_fp32_param(p)
    return out


def moe_save(case: EngineCase, root: str, frozen: bool = True) -> dict[str, Any]:
    """One optimizer step at lr 0.1, then save_checkpoint (tag "t") and save_16bit_model."""
    rank = dist.get_rank()
    engine = moe_engine(case, frozen=frozen)
    for micro in range(case_ga(engine)):
        x, y = micro_batch(rank, 0, micro)
        engine.backward(engine(x, y))
        engine.step()
    state = _moe_state(engine)
    engine.save_checkpoint(root, tag="t")
    engine.save_16bit_model(root, "model.safetensors")
    dist.barrier()
    return {"state": state, "consolidated": consolidate_fp32(root, "t") if rank == 0 else None}


def moe_load(case: EngineCase, root: str, frozen: bool = True, was_frozen: bool = True) -> dict[str, Any]:
    """A fresh engine (frozen weights perturbed) loading the checkpoint of `moe_save`; a weight
    frozen on one side only has no optimizer state to load (so none is loaded)."""
    engine = moe_engine(case, perturb=True, frozen=frozen)
    same = frozen == was_frozen  # otherwise the optimizer's param groups differ too
    engine.load_checkpoint(root, tag="t", load_optimizer_states=same, load_lr_scheduler_states=same)
    return {"state": _moe_state(engine)}


def case_ga(engine) -> int:
    return engine.gradient_accumulation_steps()


# ------------------------------------------------------------------------------- AutoEP


def autoep_config(autoep_size: int, stage: int) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "expert_parallel": {"enabled": True, "autoep_size": autoep_size},
        "steps_per_print": 1000,
    }


def autoep_engine(autoep_size: int, stage: int, perturb: bool = False):
    """AutoEP on the tiny Mixtral with its experts frozen (a router-and-attention fine-tune);
    at stage 3 built under zero.Init (DeepSpeed's idiom), so the swap sees partitioned weights."""
    config = autoep_config(autoep_size, stage)
    with zeroshard.zero.Init(config_dict_or_path=config, enabled=stage == 3):
        model = build_hf("mixtral")
    for name, p in model.named_parameters():
        if ".experts." in name:
            p.requires_grad_(False)
            if perturb:
                with zeroshard.zero.GatheredParameters([p], modifier_rank=0), torch.no_grad():
                    p.add_(1.0)
    engine, _, _, _ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def _autoep_state(engine) -> dict[str, Any]:
    """Every rank's expert stacks gathered into the global ones (by an all_gather of the module's
    values, outside the checkpoint code), the routers' weights, and whether each is trainable."""
    stacks, routers, trainable = {}, {}, {}
    world = dist.get_world_size()
    for name, layer in autoep_layers(engine.module):
        for stack in ("w1", "w2", "w3"):
            p = getattr(layer.experts, stack)
            parts = [torch.empty_like(p) for _ in range(world)]
            dist.all_gather(parts, p.detach().contiguous())
            # ranks 0..autoep_size-1 hold the blocks of experts in order
            stacks[f"{name}.experts.{stack}"] = torch.cat(parts[: layer.ep_size])
            trainable[f"{name}.experts.{stack}"] = p.requires_grad
        gate = layer.router.gate.weight
        routers[f"{name}.router.gate.weight"] = zeroshard.safe_get_full_fp32_param(gate)
        trainable[f"{name}.router.gate.weight"] = gate.requires_grad
    return {"stacks": stacks, "routers": routers, "trainable": trainable}


def autoep_save(autoep_size: int, stage: int, root: str) -> dict[str, Any]:
    """Routers before, one step at lr 0.1, the state after; save_16bit_model and save_checkpoint."""
    rank = dist.get_rank()
    engine = autoep_engine(autoep_size, stage)
    before = _autoep_state(engine)["routers"]
    x = batch(rank)
    engine.backward(engine(input_ids=x, labels=x).loss)
    engine.step()
    after = _autoep_state(engine)
    engine.save_16bit_model(root, "model.safetensors")
    engine.save_checkpoint(root, tag="t")
    dist.barrier()
    return {"before": before, **after, "consolidated": consolidate_fp32(root, "t") if rank == 0 else None}


def autoep_load(autoep_size: int, stage: int, root: str) -> dict[str, Any]:
    """A fresh engine (frozen experts perturbed) at `autoep_size` loading `autoep_save`'s checkpoint."""
    engine = autoep_engine(autoep_size, stage, perturb=True)
    engine.load_checkpoint(root, tag="t")
    return _autoep_state(engine)
