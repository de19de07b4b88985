"""DeepSpeed's `deepspeed.utils.zero_to_fp32` functions over zeroshard checkpoints: the full fp32
state dict of a sharded checkpoint, in memory, written to a folder, or loaded into a model.

They read what `engine.save_checkpoint` wrote (any world size and stage), without a process
group, through `consolidate_fp32` (export.py), and checkpoints DeepSpeed 0.19 wrote (stages 0-3,
universal) through checkpoint/deepspeed/fp32.py. Differences from DeepSpeed's: `lazy_mode=True`
returns ordinary tensors (the values are the same; DeepSpeed's lazy tensors only defer reading),
and `convert_zero_checkpoint_to_fp32_state_dict` writes one file, never shards
(`max_shard_size` is accepted for the signature: the safetensors file is streamed, so its size
does not bound the host's memory).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch

from zeroshard.checkpoint.async_save import join_writer
from zeroshard.checkpoint.deepspeed.convert import deepspeed_tag_dir
from zeroshard.checkpoint.deepspeed.fp32 import deepspeed_fp32_state_dict
from zeroshard.checkpoint.export import _write_state_dict, consolidate_fp32, write_fp32
from zeroshard.checkpoint.format import CheckpointReader, resolve_checkpoint_dir

logger = logging.getLogger("zeroshard")


def get_fp32_state_dict_from_zero_checkpoint(
    checkpoint_dir: str | os.PathLike,
    tag: str | None = None,
    exclude_frozen_parameters: bool = False,
    lazy_mode: bool = False,
) -> dict[str, torch.Tensor]:
    """The fp32 state dict of the checkpoint `tag` (default: the one `latest` names) under
    `checkpoint_dir`; with `exclude_frozen_parameters`, without the parameters that did not train.
    An asynchronous save this process started is waited for first (not a collective)."""
    join_writer()
    ds_tag_dir = deepspeed_tag_dir(checkpoint_dir, tag)
    if ds_tag_dir is not None:  # a checkpoint DeepSpeed wrote (or ds_to_universal)
        return deepspeed_fp32_state_dict(ds_tag_dir, exclude_frozen_parameters)
    tag_dir = resolve_checkpoint_dir(checkpoint_dir, tag)
    state = consolidate_fp32(tag_dir)
    if exclude_frozen_parameters:
        with CheckpointReader(tag_dir) as reader:
            frozen = set(reader.index.get("frozen_params", {}))
        state = {k: v for k, v in state.items() if k not in frozen}
    return state


def convert_zero_checkpoint_to_fp32_state_dict(
    checkpoint_dir: str | os.PathLike,
    output_dir: str | os.PathLike,
    max_shard_size: str | int = "5GB",
    safe_serialization: bool = False,
    tag: str | None = None,
    exclude_frozen_parameters: bool = False,
) -> Path:
    """Write the fp32 state dict to `output_dir/model.safetensors` (`safe_serialization`) or
    `output_dir/pytorch_model.bin` (torch.save), the names DeepSpeed and `from_pretrained` use;
    returns the file. The safetensors file of a zeroshard checkpoint is streamed parameter by
    parameter (export.write_fp32): the host holds one parameter, not the model."""
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    path = output_dir / ("model.safetensors" if safe_serialization else "pytorch_model.bin")
    if safe_serialization and deepspeed_tag_dir(checkpoint_dir, tag) is None:
        tag_dir = resolve_checkpoint_dir(checkpoint_dir, tag)
        exclude: frozenset[str] = frozenset()
        if exclude_frozen_parameters:
            with CheckpointReader(tag_dir) as reader:
                exclude = frozenset(reader.index.get("frozen_params", {}))
        return write_fp32(tag_dir, path, exclude=exclude)
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag, exclude_frozen_parameters)
    _write_state_dict(state, path, {"format": "pt"} if safe_serialization else None)
    return path


def load_state_dict_from_zero_checkpoint(model: Any, checkpoint_dir: str | os.PathLike, tag: str | None = None) -> Any:
    """Move `model` to the CPU and load the checkpoint's fp32 weights into it (`strict=False`, as
    DeepSpeed); returns the model. Use it on a plain model, not on one an engine still wraps."""
    logger.info("Extracting fp32 weights")
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    model = model.cpu()
    model.load_state_dict(state, strict=False)
    return model
