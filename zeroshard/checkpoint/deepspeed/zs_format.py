"""A PortableState to and from zeroshard's own checkpoint format ([Note: checkpoint layout]).

`write_zeroshard` writes the state as a checkpoint of a one-rank run: one flat buffer per
optimizer param group, every parameter one fragment. zeroshard loads that on any world size
and stage like any of its checkpoints (load.py reads the fragments each new shard overlaps).
`read_zeroshard` reads any zeroshard checkpoint back into whole tensors.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from zeroshard.checkpoint.base import CheckpointError, rank_file_name
from zeroshard.checkpoint.deepspeed.portable import STATE_KEYS, PortableState
from zeroshard.checkpoint.format import (
    EXTRAS_FILE,
    FORMAT_NAME,
    FORMAT_VERSION,
    INDEX_DIGEST_FILE,
    INDEX_FILE,
    LATEST_FILE,
    MASTER_KIND,
    PYTHON_STATE_FILE,
    CheckpointReader,
    dtype_to_str,
    file_digest,
    index_digest_text,
    resolve_checkpoint_dir,
    scalar_kind,
    state_kind,
    tensor_name,
    validate_tag,
)
from zeroshard.checkpoint.save import json_hyper, json_roundtrips

# What the index records about where a converted checkpoint came from.
SOURCE_KEY = "converted_from"
_PRECISION_MODE = {"fp32": "fp32", "bf16": "bf16", "fp16": "fp16"}


def _accumulation(state: PortableState) -> int:
    """DeepSpeed saves no micro-step counter: every optimizer step took gradient_accumulation_steps."""
    steps = state.config.get("gradient_accumulation_steps", 1)
    return steps if isinstance(steps, int) and not isinstance(steps, bool) and steps > 0 else 1


def write_zeroshard(state: PortableState, save_dir: str | os.PathLike, tag: str, source: dict[str, Any]) -> Path:
    """Write `state` as zeroshard checkpoint `save_dir/tag` (one rank) and point `latest` at it."""
    save_dir = Path(save_dir)
    tag_dir = save_dir / validate_tag(tag)
    if tag_dir.exists():
        raise CheckpointError(f"{tag_dir}: already exists; choose another destination (nothing is overwritten).")
    tag_dir.mkdir(parents=True)
    tensors: dict[str, torch.Tensor] = {}
    params: dict[str, Any] = {}
    flats = []
    for g, names in enumerate(state.groups):
        fid = f"flat{g}"
        masters, start = [], 0
        keys = [k for k in STATE_KEYS if names and k in state.optimizer_state.get(names[0], {})]
        moments: dict[str, list[torch.Tensor]] = {k: [] for k in keys}
        for name in names:
            master = state.masters[name]
            masters.append(master.reshape(-1).float())
            for key in keys:
                moments[key].append(state.optimizer_state[name][key].reshape(-1))
            params[name] = {
                "shape": list(master.shape), "param_dtype": dtype_to_str(state.param_dtype),
                "master_dtype": "float32", "unit": "", "role": "all", "optimizer_group": g,
                "optimizer_state": {k: dtype_to_str(state.optimizer_state[name][k].dtype) for k in keys},
                "optimizer_scalars": {"step": "tensor"} if state.steps[g] is not None else {},
                "fragments": [{"rank": 0, "offset": 0, "numel": master.numel(), "tensor": fid, "start": start}]
                if master.numel() else [],
            }
            start += master.numel()
        tensors[tensor_name(MASTER_KIND, fid)] = torch.cat(masters) if masters else torch.zeros(0)
        for key in keys:
            tensors[tensor_name(state_kind(key), fid)] = torch.cat(moments[key])
        if state.steps[g] is not None:
            tensors[tensor_name(scalar_kind("step"), fid)] = torch.tensor(float(state.steps[g]))
        flats.append({"id": fid, "unit": "", "role": "all", "optimizer_group": g, "names": list(names),
                      "numel": start, "padded_numel": start, "shard_numel": start})
    save_file(tensors, str(tag_dir / rank_file_name(0)), metadata={"rank": "0", "world_size": "1"})
    extras = {**state.frozen, **state.buffers}
    save_file({k: v.detach().clone().contiguous() for k, v in extras.items()}, str(tag_dir / EXTRAS_FILE))
    python_state: dict[str, Any] = {}
    client_entry: dict[str, Any] = {"json": state.client_state}
    if not json_roundtrips(state.client_state):
        python_state["client_state"] = state.client_state
        client_entry = {"file": PYTHON_STATE_FILE}
    scheduler_entry: dict[str, Any] | None = None
    if state.lr_scheduler is not None:
        scheduler_entry = {"json": state.lr_scheduler}
        if not json_roundtrips(state.lr_scheduler):
            python_state["lr_scheduler"] = state.lr_scheduler
            scheduler_entry = {"file": PYTHON_STATE_FILE}
    if python_state:
        torch.save(python_state, tag_dir / PYTHON_STATE_FILE)
    files = {}
    for name in (rank_file_name(0), EXTRAS_FILE, PYTHON_STATE_FILE):
        if (tag_dir / name).exists():
            size, sha = file_digest(tag_dir / name)
            files[name] = {"size": size, "sha256": sha}

    def describe(table: dict[str, torch.Tensor]) -> dict[str, Any]:
        return {n: {"shape": list(t.shape), "dtype": dtype_to_str(t.dtype)} for n, t in table.items()}

    index = {
        "format": FORMAT_NAME, "version": FORMAT_VERSION, "tag": tag, "world_size": 1,
        "stage": state.stage, "precision_mode": _PRECISION_MODE[state.precision],
        "torch_version": torch.__version__, "files": files, "params": params, "aliases": state.aliases,
        "frozen_params": describe(state.frozen), "buffers": describe(state.buffers),
        "state_dict_keys": state.module_keys, "autoep": {}, "flats": flats,
        "counters": {"global_steps": state.global_steps, "micro_steps": state.global_steps * _accumulation(state),
                     "gradient_accumulation_steps": _accumulation(state),
                     "skipped_steps": state.skipped_steps, "global_samples": state.global_samples},
        "optimizer": {"class": state.optimizer_class, "param_groups": [json_hyper(h) for h in state.hyper]},
        "loss_scaler": state.loss_scaler, "lr_scheduler": scheduler_entry, "data_sampler": None,
        "client_state": client_entry, "index_digest": INDEX_DIGEST_FILE, "config": state.config,
        SOURCE_KEY: {**source, "stage": state.stage, "world_size": state.world_size, "precision": state.precision},
    }
    data = (json.dumps(index, indent=1, default=str) + "\n").encode("utf-8")
    (tag_dir / INDEX_FILE).write_bytes(data)
    (tag_dir / INDEX_DIGEST_FILE).write_text(index_digest_text(data))
    (save_dir / LATEST_FILE).write_text(tag + "\n")
    return tag_dir


def _entry(reader: CheckpointReader, entry: dict[str, Any] | None, key: str, allow_pickle: bool) -> Any:
    if entry is None:
        return None
    if "json" in entry:
        return entry["json"]
    path = reader.verify_file(PYTHON_STATE_FILE)
    try:
        table = torch.load(path, map_location="cpu", weights_only=not allow_pickle)
    except Exception as error:
        raise CheckpointError(
            f"{path}: holds Python objects other than containers, numbers, strings and tensors, or is unreadable "
            f"({type(error).__name__}); pass --allow-pickle (allow_pickle=True) if you trust this checkpoint."
        ) from None
    return table.get(key) if isinstance(table, dict) else None


def read_zeroshard(ckpt_dir: str | os.PathLike, tag: str | None = None, allow_pickle: bool = False) -> PortableState:
    """Any zeroshard checkpoint (a save directory or a tag directory) as whole tensors."""
    from zeroshard.checkpoint.async_save import join_writer

    join_writer()  # a save this process is still writing is read once complete
    tag_dir = resolve_checkpoint_dir(ckpt_dir, tag)
    with CheckpointReader(tag_dir) as reader:
        index = reader.index
        by_group: dict[int, list[str]] = {}
        for name, entry in index["params"].items():
            by_group.setdefault(int(entry.get("optimizer_group", 0)), []).append(name)
        order = {name: i for i, name in enumerate(index["state_dict_keys"])}
        groups = [sorted(by_group[g], key=lambda n: order.get(n, len(order))) for g in sorted(by_group)]
        masters, moments, steps = {}, {}, []
        for names in groups:
            step = None
            for name in names:
                entry = index["params"][name]
                masters[name] = reader.read_full(name).float()
                moments[name] = {k: reader.read_full(name, state_kind(k)) for k in entry["optimizer_state"]}
            scalars = index["params"][names[0]]["optimizer_scalars"] if names else {}
            if "step" in scalars:
                value = reader.read_scalar(names, "step")
                step = None if value is None else float(value)
            steps.append(step)
        extras = reader.extras()
        optimizer = index.get("optimizer") or {"class": "AdamW", "param_groups": []}
        hyper = []
        for group in optimizer["param_groups"]:
            values = dict(group["hyper"])
            for key in group.get("tuple_keys", []):
                values[key] = tuple(values[key])
            hyper.append(values)
        source = index.get(SOURCE_KEY) or {}
        mode = str(index.get("precision_mode", "fp32"))
        counters = index.get("counters") or {}
        return PortableState(
            groups=groups, masters=masters, optimizer_state=moments, steps=steps, hyper=hyper,
            optimizer_class=str(optimizer["class"]), module_keys=list(index["state_dict_keys"]),
            buffers={n: extras[n] for n in index.get("buffers", {})},
            frozen={n: extras[n] for n in index.get("frozen_params", {})},
            aliases=dict(index.get("aliases", {})),
            global_steps=int(counters.get("global_steps", 0)), global_samples=int(counters.get("global_samples", 0)),
            skipped_steps=int(counters.get("skipped_steps", 0)),
            lr_scheduler=_entry(reader, index.get("lr_scheduler"), "lr_scheduler", allow_pickle),
            loss_scaler=index.get("loss_scaler") or {"kind": "none"},
            client_state=_entry(reader, index.get("client_state"), "client_state", allow_pickle) or {},
            stage=int(source.get("stage", index.get("stage", 0))),
            world_size=int(source.get("world_size", index["world_size"])),
            precision=source.get("precision") or ("bf16" if "bf16" in mode else "fp16" if "fp16" in mode else "fp32"),
            config=dict(index.get("config") or {}),
        )
