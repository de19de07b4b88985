"""Writing a PortableState as a checkpoint DeepSpeed 0.19's `load_checkpoint` resumes.

The files are the ones DeepSpeed itself writes for the state's stage, precision and world size
([Note: DeepSpeed's checkpoint layouts] in read_ds.py), with the keys it writes. Limits, because
the layout here must equal the one the loading DeepSpeed engine builds: one ZeRO-3 sub-group per
param group (DeepSpeed's default `sub_group_size` of 1e9 elements), no tensor/pipeline
parallelism, Adam/AdamW state (Muon's at stages 1-2), and (fp16 at stage 0) DeepSpeed's unfused
wrapper.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch

from zeroshard.checkpoint.base import CheckpointError
from zeroshard.checkpoint.deepspeed.ds_pickle import (
    DynamicLossScaler,
    FragmentAddress,
    LossScaler,
    save_pt,
    zero_stage_enum,
)
from zeroshard.checkpoint.deepspeed.portable import (
    ADAM_STATE_KEYS,
    MUON_CLASS,
    MUON_STATE_KEY,
    STATE_KEYS,
    PortableState,
)
from zeroshard.checkpoint.deepspeed.read_ds import MODEL_FILE
from zeroshard.checkpoint.format import validate_tag

DS_VERSION = "0.19.8"


def _group_entry(state: PortableState, g: int, params: list[int]) -> dict[str, Any]:
    return {**state.hyper[g], "params": params}


def _step_tensor(state: PortableState, g: int) -> torch.Tensor:
    return torch.tensor(float(state.steps[g] or 0.0))


def _loss_scaler(state: PortableState) -> Any:
    scaler = state.loss_scaler
    if scaler.get("kind") == "dynamic":
        fp16 = state.config.get("fp16") or {}
        hysteresis = int(fp16.get("hysteresis", 2))
        return DynamicLossScaler(  # DeepSpeed's attributes, in its order
            cur_scale=float(scaler["scale"]), dynamic=True, cur_iter=int(scaler["iteration"]),
            last_overflow_iter=int(scaler["last_overflow_iteration"]), scale_factor=2.0,
            scale_window=int(fp16.get("loss_scale_window", 1000)), min_scale=fp16.get("min_loss_scale", 1),
            delayed_shift=hysteresis, cur_hysteresis=int(scaler["hysteresis_left"]),
            consecutive_hysteresis=bool(fp16.get("consecutive_hysteresis", False)),
            raise_error_at_min_scale=True, dtype=torch.float16,
        )
    return LossScaler(cur_scale=float(scaler.get("scale", 1.0)), dynamic=False)


def _model_states(state: PortableState, module: dict[str, torch.Tensor], optimizer: Any) -> dict[str, Any]:
    shapes = [OrderedDict((n, torch.Size(state.masters[n].shape)) for n in names) for names in state.groups]
    table: dict[str, Any] = {
        "module": OrderedDict((k, module[k]) for k in state.module_keys if k in module),
        "buffer_names": list(state.buffers),
        "optimizer": optimizer,
        "param_shapes": shapes if state.stage > 0 else None,
        "frozen_param_shapes": OrderedDict((n, torch.Size(t.shape)) for n, t in state.frozen.items())
        if state.stage > 1 else None,  # DeepSpeed records frozen parameters from stage 2 on
        "shared_params": dict(state.aliases) if state.stage > 0 else None,
        "frozen_param_fragments": OrderedDict() if state.stage > 1 else None,
        "lr_scheduler": state.lr_scheduler,
        "data_sampler": None,
        "random_ltd": None,
        "skipped_steps": state.skipped_steps,
        "global_steps": state.global_steps,
        "global_samples": state.global_samples,
        "dp_world_size": state.world_size,
        "mp_world_size": 1,
        "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 1},
        "ds_config": state.config,
        "ds_version": DS_VERSION,
    }
    clash = sorted(set(state.client_state) & set(table))
    if clash:
        raise CheckpointError(f"client_state keys {clash} would overwrite DeepSpeed's own entries of the model "
                              "states file; rename them.")
    table.update(state.client_state)
    return table


def _module(state: PortableState, empty_params: bool) -> dict[str, torch.Tensor]:
    dtype = state.param_dtype
    module = {n: torch.empty(0, dtype=dtype) if empty_params else t.to(dtype).clone() for n, t in state.masters.items()}
    module.update({a: module[o] for a, o in state.aliases.items() if o in module})
    module.update(state.buffers)
    module.update({n: t.to(dtype) for n, t in state.frozen.items()})
    return module


def _write_stage0(state: PortableState, tag_dir: Path) -> None:
    index = {name: i for i, name in enumerate(state.names)}
    inner = {
        "state": {index[n]: {"step": _step_tensor(state, g),
                             **{k: state.optimizer_state[n][k].clone() for k in STATE_KEYS
                                if k in state.optimizer_state[n]}}
                  for g, names in enumerate(state.groups) for n in names},
        "param_groups": [_group_entry(state, g, [index[n] for n in names]) for g, names in enumerate(state.groups)],
    }
    if state.precision == "fp32":
        optimizer: dict[str, Any] = inner
    else:
        scaler = state.loss_scaler
        optimizer = {"dynamic_loss_scale": scaler.get("kind") == "dynamic",
                     "cur_scale": float(scaler.get("scale", 1.0)),
                     "cur_iter": int(scaler.get("iteration", state.global_steps)), "optimizer_state_dict": inner,
                     "fp32_groups": [[state.masters[n].clone() for n in names] for names in state.groups]}
        if scaler.get("kind") == "dynamic":
            fp16 = state.config.get("fp16") or {}
            optimizer.update(last_overflow_iter=int(scaler["last_overflow_iteration"]), scale_factor=2.0,
                             scale_window=int(fp16.get("loss_scale_window", 1000)))
    save_pt(_model_states(state, _module(state, False), optimizer), tag_dir / MODEL_FILE)


def _padded(parts: list[torch.Tensor], total: int) -> torch.Tensor:
    flat = torch.cat([p.reshape(-1) for p in parts]) if parts else torch.zeros(0)
    return torch.cat([flat, flat.new_zeros(total - flat.numel())])


def _optim_name(state: PortableState, rank: int) -> str:
    return ("bf16_" if state.precision == "bf16" else "") + f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


def _outer(state: PortableState, optimizer_state_dict: dict[str, Any]) -> dict[str, Any]:
    return {"optimizer_state_dict": optimizer_state_dict, "ds_config": state.config, "ds_version": DS_VERSION}


def _write_zero12(state: PortableState, tag_dir: Path) -> None:
    world = state.world_size
    groups = []  # per group: (flat masters, {key: flat}, partition size, padding)
    for names in state.groups:
        total = sum(state.masters[n].numel() for n in names)
        padded = 2 * world * math.ceil(total / (2 * world))  # ZeRO-1/2 aligns a group to 2 * world size
        flat = _padded([state.masters[n].float() for n in names], padded)
        keys = [k for k in ADAM_STATE_KEYS if names and k in state.optimizer_state[names[0]]]
        moments = {k: _padded([state.optimizer_state[n][k] for n in names], padded) for k in keys}
        groups.append((names, flat, moments, padded // world, padded - total))
    for rank in range(world):
        partitions, base_state, mappings = [], {}, []
        for g, (names, flat, moments, part, padding) in enumerate(groups):
            lo, hi = rank * part, (rank + 1) * part
            # DeepSpeed saves the fp32 partition without the group's padding (the last rank's tail).
            partitions.append(flat[lo : hi - (padding if rank == world - 1 else 0)].clone())
            base_state[g] = {"step": _step_tensor(state, g), **{k: v[lo:hi].clone() for k, v in moments.items()}}
            mapping, offset = OrderedDict(), 0
            for n in names:
                numel = state.masters[n].numel()
                start, stop = max(offset, lo), min(offset + numel, hi)
                if start < stop:
                    mapping[n] = FragmentAddress(numel=stop - start, start=start - lo)
                offset += numel
            mappings.append(mapping)
            if state.hyper[g].get("use_muon"):  # whole matrices, see read_ds._muon_momenta
                base_state[g] = {MUON_STATE_KEY: torch.cat(
                    [state.optimizer_state[n][MUON_STATE_KEY].reshape(-1) for n in mapping])}
        table = {
            "loss_scaler": _loss_scaler(state), "dynamic_loss_scale": state.loss_scaler.get("kind") == "dynamic",
            "overflow": False, "clip_grad": float(state.config.get("gradient_clipping", 0.0)),
            "base_optimizer_state": {"state": base_state,
                                     "param_groups": [_group_entry(state, g, [g]) for g in range(len(groups))]},
            "single_partition_of_fp32_groups": partitions,
            "zero_stage": zero_stage_enum(state.stage),
            "group_paddings": [padding if rank == world - 1 else 0 for (_, _, _, _, padding) in groups],
            "param_alignment_paddings": [[0] * len(names) for names in state.groups],
            "partition_count": [world] * len(groups),
            "ds_version": DS_VERSION,
            "param_slice_mappings": mappings,
        }
        save_pt(_outer(state, table), tag_dir / _optim_name(state, rank))
    save_pt(_model_states(state, _module(state, False), None), tag_dir / MODEL_FILE)


def _write_zero3(state: PortableState, tag_dir: Path) -> None:
    world = state.world_size
    for rank in range(world):
        flats, inner_state = [], {}
        for g, names in enumerate(state.groups):

            def shard(t: torch.Tensor, rank: int = rank) -> torch.Tensor:
                part = math.ceil(t.numel() / world)
                padded = torch.cat([t.reshape(-1), t.new_zeros(part * world - t.numel())])
                return padded[rank * part : (rank + 1) * part]

            flats.append(torch.cat([shard(state.masters[n].float()) for n in names]))
            keys = [k for k in ADAM_STATE_KEYS if names and k in state.optimizer_state[names[0]]]
            inner_state[g] = {"step": _step_tensor(state, g),
                              **{k: torch.cat([shard(state.optimizer_state[n][k]) for n in names]) for k in keys}}
        table = {
            "zero_stage": zero_stage_enum(3), "loss_scaler": _loss_scaler(state),
            "dynamic_loss_scale": state.loss_scaler.get("kind") == "dynamic", "overflow": False,
            "partition_count": world,
            "optimizer_state_dict": {"state": inner_state,
                                     "param_groups": [_group_entry(state, g, [g]) for g in range(len(state.groups))]},
            "fp32_flat_groups": flats,
        }
        save_pt(_outer(state, table), tag_dir / _optim_name(state, rank))
        model_file = tag_dir / f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"
        save_pt(_model_states(state, _module(state, True), None), model_file)


def write_deepspeed(state: PortableState, save_dir: str | os.PathLike, tag: str) -> Path:
    """Write `state` as DeepSpeed checkpoint `save_dir/tag` and point `save_dir/latest` at it."""
    muon = state.optimizer_class in (MUON_CLASS, "ShardedMuon")
    if state.optimizer_class not in ("Adam", "AdamW") and not muon:
        raise CheckpointError(f"optimizer {state.optimizer_class}: to-deepspeed writes Adam/AdamW and Muon state only.")
    if muon and state.stage not in (1, 2):
        raise CheckpointError(f"a Muon state at stage {state.stage}: to-deepspeed writes Muon state at stages 1-2 "
                              "(DeepSpeed 0.19's ZeRO-1/2 layout, the one checked against DeepSpeed); pass --stage "
                              "1 or 2.")
    if state.stage not in (0, 1, 2, 3) or state.world_size < 1:
        raise CheckpointError(f"stage {state.stage}, world size {state.world_size}: DeepSpeed has stages 0-3 "
                              "and a world size of at least 1.")
    if muon:  # MuonWithAuxAdam sorts a Muon group's matrices by shape, largest first (stable)
        groups = [sorted(names, key=lambda n: tuple(state.masters[n].shape), reverse=True)
                  if state.hyper[g].get("use_muon") else names for g, names in enumerate(state.groups)]
        state = dataclasses.replace(state, groups=groups)
    save_dir = Path(save_dir)
    tag_dir = save_dir / validate_tag(tag)
    if tag_dir.exists():
        raise CheckpointError(f"{tag_dir}: already exists; choose another destination (nothing is overwritten).")
    tag_dir.mkdir(parents=True)
    if state.stage == 0:
        _write_stage0(state, tag_dir)
    elif state.stage in (1, 2):
        _write_zero12(state, tag_dir)
    else:
        _write_zero3(state, tag_dir)
    (save_dir / "latest").write_text(tag)
    return tag_dir
