"""The first batch must be the same on every rank of a tensor-parallel group.

Tensor ranks compute pieces of the same samples; a data loader that gives them different
samples (a `DistributedSampler` over the world instead of over the data-parallel group) trains
nonsense without any error. DeepSpeed 0.19.8 checks the first forward's inputs across the group
(`check_dataloader_inputs_same_across_ranks`, a forward pre-hook removed after one call); so
does zeroshard, by comparing a digest of every argument (shapes, dtypes and bytes of tensors,
the repr of anything else) instead of sending the tensors, and raising on every rank of the
group together, naming the ranks and the fix.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from zeroshard.comm import collectives as comm
from zeroshard.comm.collectives import Group

__all__ = ["TensorParallelInputError", "inputs_digest", "check_inputs_once"]


class TensorParallelInputError(RuntimeError):
    """The ranks of a tensor-parallel group were given different inputs."""


def inputs_digest(args: tuple, kwargs: dict) -> str:
    """A sha256 over every leaf of (args, kwargs): tensors by dtype, shape and bytes."""
    digest = hashlib.sha256()
    leaves, spec = tree_flatten((args, dict(sorted(kwargs.items()))))
    digest.update(repr(spec).encode())
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            value = leaf.detach().to("cpu").contiguous()
            digest.update(f"{value.dtype}{tuple(value.shape)}".encode())
            digest.update(value.reshape(-1).view(torch.uint8).numpy().tobytes() if value.numel() else b"")
        else:
            digest.update(repr(leaf).encode())
    return digest.hexdigest()


def check_inputs_once(module: nn.Module, group: Group) -> Any:
    """Check the first forward's inputs across `group` (a forward pre-hook that removes itself).
    Returns the hook's handle."""
    handle = None

    def hook(_module: nn.Module, args: tuple, kwargs: dict) -> None:
        handle.remove()
        digests = comm.all_gather_object(inputs_digest(args, kwargs), group=group)
        differ = [group.ranks[i] for i, d in enumerate(digests) if d != digests[0]]
        if differ:
            raise TensorParallelInputError(
                f"tensor parallelism: the first batch differs across the tensor-parallel group {list(group.ranks)} "
                f"(rank(s) {differ} differ from rank {group.ranks[0]}). Every rank of a tensor-parallel group must "
                "get the same samples: shard the data over the data-parallel group (engine.data_parallel_group; "
                "DistributedSampler(num_replicas=engine.dp_world_size, rank=engine.data_parallel_rank)), or "
                "pass training_data to initialize."
            )

    handle = module.register_forward_pre_hook(hook, prepend=True, with_kwargs=True)
    return handle
