"""`UlyssesSPDataLoaderAdapter`: each sequence-parallel rank's slice of the same samples.

Ulysses needs the P ranks of a sequence group to work on the same samples, each on 1/P of the
sequence. The adapter wraps the ordinary per-rank data loader (each rank still draws its own
batches, as under data parallelism): every P draws, the ranks of the group exchange their
batches, and then all of them go through batch 0 (rank 0's), batch 1, ..., each taking its
own slice of the sequence. After P iterations the group has consumed the same P batches data
parallelism would have, so the global batch is unchanged.

Per batch: `position_ids` are added when absent (0..seq-1); the sequence is padded to a
multiple of P (`input_ids` with `pad_token_id`, `labels` with -100, positions continuing);
`labels` are replaced by `shift_labels` (the next token's label, -100 at the end), because
the loss of a sequence slice needs the label of the first token of the next slice; then
every tensor whose first two dims are [batch, seq] is cut to this rank's slice. Other
entries are passed through. Signature and behaviour are DeepSpeed's (ulysses_sp).
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any

import torch

from zeroshard.comm import collectives as comm

__all__ = ["UlyssesSPDataLoaderAdapter"]

IGNORE_INDEX = -100


class UlyssesSPDataLoaderAdapter:
    """Wrap `dl` (yielding dicts with `input_ids` and `labels`, [batch, seq]) for the sequence
    group `sp_group` (torch ProcessGroup or `zeroshard.comm.Group`) of size `sp_world_size`,
    in which this process is `sp_rank`; tensors are moved to `device`."""

    def __init__(
        self,
        dl: Any,
        sp_rank: int,
        sp_group: Any,
        sp_world_size: int,
        device: Any,
        pad_to_sp_multiple: bool = True,
        pad_token_id: int = 0,
    ) -> None:
        self.dl = dl
        self.sp_rank, self.sp_world_size = sp_rank, sp_world_size
        self.group = comm.as_group(sp_group)
        if (self.group.size, self.group.rank) != (sp_world_size, sp_rank):
            raise ValueError(
                f"sp_rank={sp_rank}, sp_world_size={sp_world_size}: the group says rank {self.group.rank} of "
                f"{self.group.size}. Pass mpu.get_sequence_parallel_rank() and _world_size()."
            )
        self.device = device
        self.pad_to_sp_multiple = pad_to_sp_multiple
        self.pad_token_id = pad_token_id
        self.iter = iter(dl)
        self.micro_batches: deque[dict[str, Any]] = deque()

    def __len__(self) -> int:
        return len(self.dl) * self.sp_world_size

    def __iter__(self) -> UlyssesSPDataLoaderAdapter:
        return self

    def __next__(self) -> dict[str, Any]:
        if not self.micro_batches:
            self.refill()
        return self.micro_batches.popleft()

    def refill(self) -> None:
        try:
            batch = next(self.iter)
        except StopIteration:
            self.iter = iter(self.dl)  # the next epoch starts from a fresh iterator
            raise
        batch = self._checked(batch)
        # Every rank of the group draws; all of them then work on every drawn batch in turn.
        for drawn in comm.all_gather_object(batch, group=self.group):
            self.micro_batches.append(self._slice(drawn))

    def _checked(self, batch: Any) -> dict[str, Any]:
        ids = batch.get("input_ids") if isinstance(batch, dict) else None
        if not torch.is_tensor(ids) or ids.dim() != 2:
            raise ValueError("UlyssesSPDataLoaderAdapter: each batch must be a dict with [batch, seq] input_ids")
        if not torch.is_tensor(batch.get("labels")) or batch["labels"].shape[:2] != batch["input_ids"].shape:
            raise ValueError("UlyssesSPDataLoaderAdapter: each batch needs labels shaped like input_ids")
        batch = {k: v.detach().cpu() if torch.is_tensor(v) else v for k, v in batch.items()}
        if batch.get("position_ids") is None:
            rows, seq = batch["input_ids"].shape
            batch["position_ids"] = torch.arange(seq).expand(rows, seq).clone()
        return batch

    def _slice(self, batch: dict[str, Any]) -> dict[str, Any]:
        shape = batch["input_ids"].shape
        sequence_keys = [k for k, v in batch.items() if torch.is_tensor(v) and v.dim() >= 2 and v.shape[:2] == shape]
        seq = shape[1]
        if seq % self.sp_world_size:
            if not self.pad_to_sp_multiple:
                raise ValueError(
                    f"sequence length {seq} is not divisible by sp_world_size={self.sp_world_size}. "
                    "Pad the batches, or leave pad_to_sp_multiple=True."
                )
            padded = math.ceil(seq / self.sp_world_size) * self.sp_world_size
            batch = {k: _pad(k, v, padded, self.pad_token_id) if k in sequence_keys else v for k, v in batch.items()}
            seq = padded
        labels = batch.pop("labels")
        batch["shift_labels"] = torch.nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[:, 1:].contiguous()
        sequence_keys = [k for k in sequence_keys if k != "labels"] + ["shift_labels"]
        chunk = seq // self.sp_world_size
        mine = slice(chunk * self.sp_rank, chunk * (self.sp_rank + 1))
        out = {}
        for key, value in batch.items():
            if key in sequence_keys:
                value = value[:, mine].contiguous()
            out[key] = value.to(self.device) if torch.is_tensor(value) else value
        return out


def _pad(key: str, tensor: torch.Tensor, length: int, pad_token_id: int) -> torch.Tensor:
    extra = length - tensor.shape[1]
    if key == "position_ids":  # positions go on counting, so the padding stays causal-consistent
        steps = torch.arange(1, extra + 1, dtype=tensor.dtype)
        return torch.cat((tensor, tensor[:, -1:] + steps), dim=1)
    fill = IGNORE_INDEX if key in ("labels", "shift_labels") else pad_token_id if key == "input_ids" else 0
    padding = torch.full((tensor.shape[0], extra, *tensor.shape[2:]), fill, dtype=tensor.dtype)
    return torch.cat((tensor, padding), dim=1)
