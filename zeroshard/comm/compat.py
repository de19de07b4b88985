"""torch.distributed names that moved between torch versions.

The newest torch calls its flat collectives `reduce_scatter_single` / `all_gather_single`;
every torch since 1.13 has them as `reduce_scatter_tensor` / `all_gather_into_tensor` (same
arguments, same semantics). These use whichever the installed torch has, looked up at each
call, so zeroshard runs on the whole `torch>=2.4` range pyproject.toml declares.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

# (newest name, older name) per collective.
_NAMES = {
    "reduce_scatter_single": ("reduce_scatter_single", "reduce_scatter_tensor"),
    "all_gather_single": ("all_gather_single", "all_gather_into_tensor"),
}


def _collective(name: str):
    for candidate in _NAMES[name]:
        fn = getattr(dist, candidate, None)
        if fn is not None:
            return fn
    raise AttributeError(
        f"torch.distributed has neither {' nor '.join(_NAMES[name])} (torch {torch.__version__}). "
        "Install torch 2.4 or newer."
    )


def reduce_scatter_single(output: torch.Tensor, input: torch.Tensor, op=dist.ReduceOp.SUM, group=None,
                          async_op: bool = False):
    """Reduce `input` (world size x len(output) elements, flat) over the group; keep this rank's chunk."""
    return _collective("reduce_scatter_single")(output, input, op=op, group=group, async_op=async_op)


def all_gather_single(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False):
    """Concatenate every rank's `input` into `output` (world size x len(input) elements, flat)."""
    return _collective("all_gather_single")(output, input, group=group, async_op=async_op)


def set_group_timeout(handle, timeout) -> None:
    """Change an existing process group's collective timeout (torch's private
    `_set_pg_timeout`, present since torch 2.2); without it the group keeps its own."""
    setter = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
    if setter is not None:
        setter(timeout, handle)
