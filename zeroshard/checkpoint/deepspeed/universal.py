"""Reading a DeepSpeed universal checkpoint (`ds_to_universal` output) into a PortableState.

Layout: the tag directory keeps the model-states file(s) of the source checkpoint, and
`zero/<parameter name>/` holds one file per kind (`fp32.pt`, `exp_avg.pt`, `exp_avg_sq.pt`,
`step.pt`), each `{"param": whole tensor, ...}`; `zero/optimizer_state.pt` holds the rest of the
optimizer state (param groups, loss scaler). Nothing in it depends on the saving world size,
so it loads on any world size and stage, as zeroshard's own checkpoints do.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from zeroshard.checkpoint.base import CheckpointError
from zeroshard.checkpoint.deepspeed.portable import ADAM_STATE_KEYS, PortableState
from zeroshard.checkpoint.deepspeed.read_autotp import Joiner, whole_shapes_of
from zeroshard.checkpoint.deepspeed.read_ds import (
    MODEL_FILE,
    _common,
    _hyper,
    _need,
    _optimizer_class,
    _scaler_state,
    read_model_states,
)
from zeroshard.checkpoint.deepspeed.unpickle import load_pt

ZERO_DIR = "zero"
OPTIMIZER_FILE = "optimizer_state.pt"
UNIVERSAL_LATEST = "latest_universal"


def is_universal_tag_dir(path: Path) -> bool:
    return (Path(path) / ZERO_DIR / OPTIMIZER_FILE).is_file()


def _model_file(tag_dir: Path) -> Path:
    for name in (MODEL_FILE, "zero_pp_rank_0_mp_rank_00_model_states.pt"):
        if (tag_dir / name).is_file():
            return tag_dir / name
    raise CheckpointError(f"{tag_dir}: a universal checkpoint without {MODEL_FILE}; copy the whole directory "
                          "that ds_to_universal wrote.")


def _param_file(tag_dir: Path, name: str, kind: str, allow_pickle: bool) -> Any:
    path = tag_dir / ZERO_DIR / name / f"{kind}.pt"
    if not path.is_file():
        raise CheckpointError(f"{path}: missing; ds_to_universal writes {kind}.pt for every parameter. "
                              "Run it again on the source checkpoint.")
    table = load_pt(path, allow_pickle)
    if kind == "step" and isinstance(table, (torch.Tensor, int, float)):  # step.pt holds the bare value
        return table
    return _need(table, "param", path)


def _join_frozen(tag_dir: Path, model: dict[str, Any], allow_pickle: bool) -> dict[str, torch.Tensor]:
    """The frozen parameters of an AutoTP save, whole: each tensor rank's model states hold its
    pieces (the `zero/` folder has the trained parameters only)."""
    parts = int(model["mp_world_size"])
    modules = [read_model_states(tag_dir, t, allow_pickle) for t in range(parts)]
    joiner = Joiner(model["universal_checkpoint_info"], modules[0][0], parts)
    frozen = model.get("frozen_param_shapes") or {}
    return {name: joiner.join(name, [m["module"][name] for _, m in modules]) for name in frozen}


def read_universal(tag_dir: str | Path, allow_pickle: bool = False) -> PortableState:
    tag_dir = Path(tag_dir)
    model_path = _model_file(tag_dir)
    model = load_pt(model_path, allow_pickle)
    state = _common(model, model_path, allow_pickle)
    # AutoTP: ds_to_universal wrote whole tensors, the model states describe tensor rank 0's pieces.
    whole_shapes = whole_shapes_of(model)
    if whole_shapes is not None and state.frozen:
        state.frozen = _join_frozen(tag_dir, model, allow_pickle)
    optimizer_path = tag_dir / ZERO_DIR / OPTIMIZER_FILE
    optim = load_pt(optimizer_path, allow_pickle)
    state.stage = int(optim.get("zero_stage", 2))
    shapes = _need(model, "param_shapes", model_path)
    groups_meta = _need(optim, "param_groups", optimizer_path)
    for group_shapes in shapes:
        names = list(group_shapes)
        step = None
        for name in names:
            shape = tuple(group_shapes[name])
            if whole_shapes is not None:
                shape = whole_shapes.get(name, shape)
            master = _param_file(tag_dir, name, "fp32", allow_pickle)
            if tuple(master.shape) != shape:
                raise CheckpointError(f"{tag_dir / ZERO_DIR / name / 'fp32.pt'}: shape {list(master.shape)}, the model "
                                      f"states say {list(shape)}; the folders belong to different checkpoints.")
            state.masters[name] = master.detach().float().clone()
            state.optimizer_state[name] = {
                key: _param_file(tag_dir, name, key, allow_pickle).detach().clone().reshape(shape)
                for key in ADAM_STATE_KEYS
                if (tag_dir / ZERO_DIR / name / f"{key}.pt").is_file()
            }
            if step is None and (tag_dir / ZERO_DIR / name / "step.pt").is_file():
                value = _param_file(tag_dir, name, "step", allow_pickle)
                step = float(value.item() if isinstance(value, torch.Tensor) else value)
        state.groups.append(names)
        state.steps.append(step)
    state.hyper = _hyper(groups_meta)[: len(shapes)]
    state.optimizer_class = _optimizer_class(groups_meta, state.config)
    state.loss_scaler = _scaler_state(optim.get("loss_scaler"), bool(optim.get("dynamic_loss_scale")), state.precision)
    return state
