"""DeepSpeed's `zero_to_fp32` over a DeepSpeed checkpoint: the full fp32 state dict, read
through read_ds.py / universal.py, so `zeroshard to-fp32` and the alias's
`deepspeed.utils.zero_to_fp32` functions take a DeepSpeed save directory as well as a zeroshard one.
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import torch

from zeroshard.checkpoint.deepspeed.convert import read_any_deepspeed


def deepspeed_fp32_state_dict(tag_dir: Path, exclude_frozen_parameters: bool = False,
                              allow_pickle: bool = False) -> dict[str, torch.Tensor]:
    """DeepSpeed's own order and dtypes: buffers (floating ones as fp32), frozen parameters (as
    saved), the fp32 masters, then tied names pointing at their owner's tensor."""
    state = read_any_deepspeed(Path(tag_dir), allow_pickle)
    out: dict[str, torch.Tensor] = OrderedDict(
        (name, t.float() if t.is_floating_point() else t) for name, t in state.buffers.items()
    )
    if not exclude_frozen_parameters:
        out.update(state.frozen)
    for name in state.names:
        out[name] = state.masters[name]
    for alias, owner in state.aliases.items():
        if owner in out:
            out[alias] = out[owner]
    return out
