"""Reading a checkpoint DeepSpeed 0.19 saved (ZeRO stages 0-3, fp32/bf16/fp16) into a PortableState.

[Note: DeepSpeed's checkpoint layouts]
A tag directory holds `mp_rank_00_model_states.pt` (stages 0-2; at stage 3 one
`zero_pp_rank_<r>_mp_rank_00_model_states.pt` per rank) with the module's state dict, the
counters, the scheduler state, the parameter names and shapes (`param_shapes`, one table per
optimizer param group) and the client state at top level. The optimizer state is:

- stage 0, fp32: torch's own `optimizer.state_dict()` under `optimizer` (state by parameter index);
- stage 0, bf16/fp16: the unfused 16-bit wrapper's table under `optimizer`: `fp32_groups`
  (one fp32 copy per parameter) and the inner optimizer's `optimizer_state_dict`;
- stages 1-2: per rank `[bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt`: for each param
  group the rank's slice of the group's flat fp32 buffer (`single_partition_of_fp32_groups`)
  and of its Adam moments (`base_optimizer_state`). The group's parameters follow each other
  in that buffer (plus `param_alignment_paddings` after each), and the buffer is cut into
  `partition_count` equal slices;
- stage 3: per rank `fp32_flat_groups` (sub-groups, concatenated): every parameter is split on
  its own into `world_size` slices of ceil(numel / world_size) elements, and the rank's slices
  of all parameters follow each other in `param_shapes` order.

With AutoTP (`mp_world_size` > 1) every file name above exists once per tensor-parallel rank
(`mp_rank_<t>`), each describing that rank's pieces; read_autotp.py joins them.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import torch

from zeroshard.checkpoint.base import CheckpointError
from zeroshard.checkpoint.deepspeed.portable import (
    ADAM_STATE_KEYS,
    MUON_CLASS,
    MUON_STATE_KEY,
    STATE_KEYS,
    PortableState,
)
from zeroshard.checkpoint.deepspeed.read_autotp import join_tensor_ranks
from zeroshard.checkpoint.deepspeed.unpickle import StandIn, load_pt

MODEL_FILE = "mp_rank_00_model_states.pt"
_ZERO3_MODEL_RE = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_00_model_states\.pt$")


def model_file(mp: int) -> str:
    """Tensor-parallel rank `mp`'s model-states file (stages 0-2)."""
    return f"mp_rank_{mp:02d}_model_states.pt"


def _optim_re(mp: int) -> re.Pattern:
    return re.compile(rf"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_{mp:02d}_optim_states\.pt$")


def _zero3_model_re(mp: int) -> re.Pattern:
    return re.compile(rf"^zero_pp_rank_(\d+)_mp_rank_{mp:02d}_model_states\.pt$")
# Top-level keys of DeepSpeed's model-states file; every other key is the client state.
DS_MODEL_KEYS = frozenset({
    "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
    "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names",
    "skipped_steps", "global_steps", "global_samples", "dp_world_size", "mp_world_size",
    "checkpoint_parallel_dimensions", "ds_config", "ds_version", "ep_world_size", "moe_world_size",
    "num_experts", "autoep_layers", "universal_checkpoint_info",
})


def is_deepspeed_tag_dir(path: Path) -> bool:
    """Whether `path` looks like one tag of a DeepSpeed save (its model-states file is there)."""
    path = Path(path)
    return (path / MODEL_FILE).is_file() or any(_ZERO3_MODEL_RE.match(p.name) for p in _listing(path))


def _listing(path: Path) -> list[Path]:
    try:
        return sorted(path.iterdir())
    except OSError:
        return []


def _rank_files(tag_dir: Path, pattern: re.Pattern, group: int) -> dict[int, Path]:
    return {int(m.group(group)): p for p in _listing(tag_dir) if (m := pattern.match(p.name))}


def _need(table: Any, key: str, where: Path) -> Any:
    if not isinstance(table, dict) or key not in table:
        raise CheckpointError(f"{where}: field {key!r} missing; not a DeepSpeed 0.19 checkpoint file.")
    return table[key]


def _check_ranks(found: dict[int, Path], world: int, tag_dir: Path, what: str, example: str) -> list[Path]:
    """The files of ranks 0..world-1, each present; the error names the missing or extra ranks."""
    missing = [r for r in range(world) if r not in found]
    extra = sorted(r for r in found if r >= world)
    if missing:
        names = ", ".join(example.format(r) for r in missing)
        raise CheckpointError(
            f"{tag_dir}: {what} of rank(s) {missing} missing ({names}); the checkpoint was saved by "
            f"{world} data-parallel ranks and needs every rank's file. Copy the whole tag directory "
            "from the run that saved it."
        )
    if extra:
        raise CheckpointError(
            f"{tag_dir}: {what} for rank(s) {extra}, but the model states say the run had {world} ranks "
            "(dp_world_size): files of another save are mixed in. Remove them or copy the tag directory again."
        )
    return [found[r] for r in range(world)]


def _precision(config: dict[str, Any]) -> str:
    for key in ("bf16", "bfloat16"):
        if isinstance(config.get(key), dict) and config[key].get("enabled"):
            return "bf16"
    if isinstance(config.get("fp16"), dict) and config["fp16"].get("enabled"):
        return "fp16"
    return "fp32"


def _scaler_state(scaler: Any, dynamic: bool, precision: str) -> dict[str, Any]:
    """DeepSpeed's loss scaler as zeroshard's scaler state (precision/loss_scale.py)."""
    if precision != "fp16":
        return {"kind": "none"}
    fields = scaler.fields if isinstance(scaler, StandIn) else dict(scaler or {})
    if not dynamic:
        return {"kind": "static", "scale": float(fields.get("cur_scale", 1.0))}
    return {
        "kind": "dynamic",
        "scale": float(fields["cur_scale"]),
        "iteration": int(fields["cur_iter"]),
        "last_overflow_iteration": int(fields["last_overflow_iter"]),
        "hysteresis_left": int(fields.get("cur_hysteresis", fields.get("delayed_shift", 1))),
    }


def _optimizer_class(groups: list[dict[str, Any]], config: dict[str, Any]) -> str:
    """torch's AdamW is Adam with decoupled weight decay; DeepSpeed's param groups say which.
    MuonWithAuxAdam's groups each say use_muon."""
    if any("use_muon" in g for g in groups):
        return MUON_CLASS
    if groups and "decoupled_weight_decay" in groups[0]:
        return "AdamW" if groups[0]["decoupled_weight_decay"] else "Adam"
    kind = str((config.get("optimizer") or {}).get("type", "AdamW"))
    return {"adam": "AdamW", "adamw": "AdamW"}.get(kind.lower(), kind)


def _hyper(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in g.items() if k != "params"} for g in groups]


def _step(state: dict[str, Any]) -> float | None:
    value = state.get("step")
    return None if value is None else float(value)


def _tensor(value: Any, where: Path, field: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise CheckpointError(f"{where}: field {field} is a {type(value).__name__}, not a tensor; the file is corrupt.")
    return value


def _split_sequential(flat: torch.Tensor, shapes: dict[str, Any], paddings: list[int] | None,
                      where: Path, field: str) -> dict[str, torch.Tensor]:
    """A ZeRO-1/2 group's flat buffer cut into its parameters."""
    out, offset = {}, 0
    for i, (name, shape) in enumerate(shapes.items()):
        numel = math.prod(shape)
        if offset + numel > flat.numel():
            raise CheckpointError(
                f"{where}: {field} holds {flat.numel()} elements, fewer than its parameters need "
                f"({name} ends at {offset + numel}); the files do not belong together."
            )
        out[name] = flat[offset : offset + numel].reshape(tuple(shape)).clone()
        offset += numel + (paddings[i] if paddings else 0)
    return out


def _module_tensors(model: dict[str, Any], where: Path) -> tuple[dict[str, torch.Tensor], list[str]]:
    module = _need(model, "module", where)
    return dict(module), list(module.keys())


def _common(model: dict[str, Any], where: Path, allow_pickle: bool) -> PortableState:
    config = model.get("ds_config") or {}
    module, keys = _module_tensors(model, where)
    buffer_names = list(model.get("buffer_names") or [])
    shared = dict(model.get("shared_params") or {})
    state = PortableState(
        groups=[], masters={}, optimizer_state={}, steps=[], hyper=[], optimizer_class="AdamW",
        module_keys=keys,
        buffers={n: module[n] for n in buffer_names if n in module},
        aliases={alias: owner for alias, owner in shared.items()},
        global_steps=int(model.get("global_steps", 0)),
        global_samples=int(model.get("global_samples", 0) or 0),
        skipped_steps=int(model.get("skipped_steps", 0)),
        lr_scheduler=model.get("lr_scheduler"),
        client_state={k: v for k, v in model.items() if k not in DS_MODEL_KEYS},
        world_size=int(_need(model, "dp_world_size", where)),
        precision=_precision(config),
        config=config,
    )
    frozen = model.get("frozen_param_shapes") or {}
    state.frozen = {n: module[n] for n in frozen if n in module}
    return state


def _read_stage0(where: Path, model: dict[str, Any], state: PortableState) -> None:
    optimizer = _need(model, "optimizer", where)
    buffer_or_frozen = set(state.buffers) | set(state.frozen) | set(state.aliases)
    trainable = [k for k in state.module_keys if k not in buffer_or_frozen]
    if state.precision == "fp32":
        inner, masters = optimizer, None
    else:
        if "fp32_groups_flat" in optimizer:
            raise CheckpointError(f"{where}: a fused fp16 optimizer state (fp32_groups_flat); zeroshard reads "
                                  "DeepSpeed's ZeRO stages 1-3 and its unfused stage-0 wrapper only.")
        inner = _need(optimizer, "optimizer_state_dict", where)
        masters = [t for group in _need(optimizer, "fp32_groups", where) for t in group]
        if state.precision == "fp16":
            fields = {"cur_scale": optimizer["cur_scale"], "cur_iter": optimizer["cur_iter"],
                      "last_overflow_iter": optimizer.get("last_overflow_iter", -1),
                      "cur_hysteresis": optimizer.get("cur_hysteresis", 1)}
            state.loss_scaler = _scaler_state(fields, bool(optimizer["dynamic_loss_scale"]), "fp16")
    groups = _need(inner, "param_groups", where)
    saved = _need(inner, "state", where)
    index_of = [i for g in groups for i in g["params"]]
    if len(index_of) != len(trainable):
        raise CheckpointError(f"{where}: the optimizer holds {len(index_of)} parameters, the module "
                              f"{len(trainable)} trainable ones; the file is inconsistent.")
    name_of = dict(zip(index_of, trainable, strict=True))
    state.groups = [[name_of[i] for i in g["params"]] for g in groups]
    module = _need(model, "module", where)
    for position, (i, name) in enumerate(zip(index_of, trainable, strict=True)):
        source = masters[position] if masters is not None else module[name]
        state.masters[name] = _tensor(source, where, f"master of {name}").detach().float().reshape(module[name].shape)
        entry = saved.get(i, {})
        state.optimizer_state[name] = {k: entry[k].detach().clone().reshape(module[name].shape)
                                       for k in STATE_KEYS if k in entry}
    state.steps = [_step(saved.get(g["params"][0], {})) if g["params"] else None for g in groups]
    state.hyper = _hyper(groups)
    state.optimizer_class = _optimizer_class(groups, state.config)


def _muon_momenta(per_rank: list[dict[str, Any]], shapes: dict[str, Any], paddings: list[int] | None, part: int,
                  where: Path, g: int) -> dict[str, torch.Tensor]:
    """A Muon group's momentum_buffer at ZeRO-1/2: unlike the fp32 partition, each rank keeps
    the whole momentum of every matrix its partition touches (Newton-Schulz needs the whole
    matrix), back to back and without alignment padding; a matrix cut by a partition boundary
    is on both ranks, identical (its gradient is all-reduced to both)."""
    out: dict[str, torch.Tensor] = {}
    for rank, saved in enumerate(per_rank):
        buffer = _tensor(saved[MUON_STATE_KEY], where, f"momentum_buffer of group {g}").reshape(-1)
        lo, hi, offset, position = rank * part, (rank + 1) * part, 0, 0
        for i, (name, shape) in enumerate(shapes.items()):
            numel = math.prod(shape)
            if numel and offset < hi and offset + numel > lo:
                if position + numel > buffer.numel():
                    raise CheckpointError(f"{where}: rank {rank}'s momentum_buffer of group {g} holds "
                                          f"{buffer.numel()} elements, fewer than its matrices need; the files "
                                          "do not belong together.")
                out.setdefault(name, buffer[position : position + numel].reshape(tuple(shape)).clone())
                position += numel
            offset += numel + (paddings[i] if paddings else 0)
    return out


def _read_zero12(where: Path, model: dict[str, Any], state: PortableState, optim: list[dict]) -> None:
    shapes = _need(model, "param_shapes", where)
    first = optim[0]
    paddings = first.get("param_alignment_paddings")
    base = [o["base_optimizer_state"] for o in optim]
    groups_meta = base[0]["param_groups"] if isinstance(base[0], dict) else None
    for g, group_shapes in enumerate(shapes):
        flat = torch.cat([_tensor(o["single_partition_of_fp32_groups"][g], where, "fp32 partition") for o in optim])
        pads = paddings[g] if paddings else None
        state.masters.update(_split_sequential(flat.detach().float(), group_shapes, pads, where, f"group {g}"))
        per_rank = [b["state"][g] if isinstance(b, dict) else b[g] for b in base]
        moments = {}
        for key in ADAM_STATE_KEYS:
            if key in per_rank[0]:
                full = torch.cat([s[key] for s in per_rank])
                moments[key] = _split_sequential(full, group_shapes, pads, where, f"{key} of group {g}")
        if MUON_STATE_KEY in per_rank[0]:
            part = optim[0]["single_partition_of_fp32_groups"][g].numel()
            moments[MUON_STATE_KEY] = _muon_momenta(per_rank, group_shapes, pads, part, where, g)
        for name in group_shapes:
            state.optimizer_state[name] = {k: moments[k][name] for k in moments}
        state.groups.append(list(group_shapes))
        state.steps.append(_step(per_rank[0]))
    state.hyper = _hyper(groups_meta) if groups_meta else [{} for _ in shapes]
    state.optimizer_class = _optimizer_class(groups_meta or [], state.config)
    state.loss_scaler = _scaler_state(first.get("loss_scaler"), bool(first.get("dynamic_loss_scale")), state.precision)


def _read_zero3(tag_dir: Path, model: dict[str, Any], state: PortableState, optim: list[dict]) -> None:
    where = tag_dir
    world = len(optim)
    shapes = _need(model, "param_shapes", where)
    flats = [torch.cat([_tensor(t, where, "fp32 flat group") for t in o["fp32_flat_groups"]]) for o in optim]
    inner = [_need(o, "optimizer_state_dict", where) for o in optim]
    sub_groups = [sorted(i["state"]) for i in inner]
    moments = {}
    for key in ADAM_STATE_KEYS:
        if key in inner[0]["state"].get(sub_groups[0][0], {}):
            moments[key] = [torch.cat([i["state"][s][key].reshape(-1) for s in subs])
                            for i, subs in zip(inner, sub_groups, strict=True)]
    offset = 0
    for group_shapes in shapes:
        for name, shape in group_shapes.items():
            numel = math.prod(shape)
            part = math.ceil(numel / world)

            def gather(per_rank: list[torch.Tensor], offset: int = offset, part: int = part,
                       numel: int = numel, shape: Any = shape) -> torch.Tensor:
                if offset + part > per_rank[0].numel():
                    raise CheckpointError(f"{where}: the ranks' flat groups are shorter than the parameters in "
                                          "param_shapes need; the files do not belong together.")
                return torch.cat([r[offset : offset + part] for r in per_rank])[:numel].reshape(tuple(shape)).clone()

            state.masters[name] = gather(flats).float()
            state.optimizer_state[name] = {k: gather(v) for k, v in moments.items()}
            offset += part
        state.groups.append(list(group_shapes))
    groups_meta = inner[0]["param_groups"]
    first_state = inner[0]["state"].get(sub_groups[0][0], {})
    state.steps = [_step(first_state) for _ in shapes]
    state.hyper = _hyper(groups_meta)[: len(shapes)]
    state.optimizer_class = _optimizer_class(groups_meta, state.config)
    outer = optim[0]
    state.loss_scaler = _scaler_state(outer.get("loss_scaler"), bool(outer.get("dynamic_loss_scale")), state.precision)


def read_model_states(tag_dir: Path, mp: int, allow_pickle: bool) -> tuple[Path, dict[str, Any]]:
    """(path, table) of tensor-parallel rank `mp`'s model states (ZeRO-3: data rank 0's)."""
    model_path = tag_dir / model_file(mp)
    zero3_models = _rank_files(tag_dir, _zero3_model_re(mp), 1)
    if not model_path.is_file() and 0 in zero3_models:
        model_path = zero3_models[0]
    if not model_path.is_file():
        raise CheckpointError(f"{tag_dir}: no {model_file(mp)} (nor zero_pp_rank_0_mp_rank_{mp:02d}_model_states.pt); "
                              "not a DeepSpeed checkpoint tag directory, or one tensor-parallel rank's files are "
                              "missing.")
    model = load_pt(model_path, allow_pickle)
    if not isinstance(model, dict):
        raise CheckpointError(f"{model_path}: holds a {type(model).__name__}, not DeepSpeed's model-states table.")
    return model_path, model


def read_deepspeed(tag_dir: str | Path, allow_pickle: bool = False) -> PortableState:
    """A DeepSpeed 0.19 checkpoint tag directory, assembled into whole tensors (an AutoTP one's
    tensor-parallel pieces joined: read_autotp.py).

    Raises:
        CheckpointError: a missing, truncated or foreign file, a rank's file missing, files of
            another world size, or a pickle naming a type outside the allow-list.
    """
    tag_dir = Path(tag_dir)
    model_path, model = read_model_states(tag_dir, 0, allow_pickle)
    parts = int(model.get("mp_world_size", 1) or 1)
    if parts != 1:  # AutoTP: each tensor rank's pieces, joined
        states = [read_tensor_rank(tag_dir, t, allow_pickle) for t in range(parts)]
        return join_tensor_ranks(states, model, model_path)
    return read_tensor_rank(tag_dir, 0, allow_pickle)


def read_tensor_rank(tag_dir: Path, mp: int, allow_pickle: bool = False) -> PortableState:
    """Tensor-parallel rank `mp`'s state: whole over the data-parallel ranks, that rank's pieces
    of what AutoTP split (the whole state without tensor parallelism)."""
    model_path, model = read_model_states(tag_dir, mp, allow_pickle)
    zero3_models = _rank_files(tag_dir, _zero3_model_re(mp), 1)
    optim_files = _rank_files(tag_dir, _optim_re(mp), 2)
    state = _common(model, model_path, allow_pickle)
    world = state.world_size
    if not optim_files:
        if zero3_models:
            raise CheckpointError(f"{tag_dir}: ZeRO-3 model states without any *_optim_states.pt file; copy "
                                  "the whole tag directory from the run that saved it.")
        state.stage = 0
        _read_stage0(model_path, model, state)
        return state
    paths = _check_ranks(optim_files, world, tag_dir, "optimizer states",
                         ("bf16_" if state.precision == "bf16" else "") + "zero_pp_rank_{}_mp_rank_"
                         + f"{mp:02d}_optim_states.pt")
    optim = []
    for path in paths:
        table = load_pt(path, allow_pickle)
        inner = _need(table, "optimizer_state_dict", path)
        optim.append(inner)
    stage = int(_need(optim[0], "zero_stage", paths[0]))
    partitions = optim[0].get("partition_count")
    counts = partitions if isinstance(partitions, list) else [partitions]
    if stage in (1, 2) and any(int(c) != world for c in counts if c is not None):
        raise CheckpointError(f"{paths[0]}: partition_count {partitions} differs from the model states' "
                              f"dp_world_size {world}; the files belong to different saves.")
    state.stage = stage
    if stage in (1, 2):
        _read_zero12(model_path, model, state, optim)
    elif stage == 3:
        _check_ranks(zero3_models, world, tag_dir, "ZeRO-3 model states",
                     "zero_pp_rank_{}_mp_rank_" + f"{mp:02d}_model_states.pt")
        _read_zero3(tag_dir, model, state, optim)
    else:
        raise CheckpointError(f"{paths[0]}: zero_stage {stage}; DeepSpeed stages are 0-3.")
    return state
