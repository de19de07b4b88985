"""Global micro-batch k: which samples it holds and which random numbers its forward draws.

The deterministic reduction (zeroshard/grads/tree_reduce.py's note) sums the gradients of the
micro-batches of a step in a tree over their global index k, where micro-batch k runs on rank
k mod W at micro-step k div W. For the sum to have the same bits at every W, micro-batch k must
be the same samples at every W, and its forward must draw the same random numbers (dropout).

Samples: torch's DistributedSampler deals single samples round-robin (rank r reads samples r,
r + W, ...), so a micro-batch of b samples holds samples W apart, and which samples share a
micro-batch changes with W. `MicroBatchSampler` deals whole micro-batches instead: the epoch's
order (the same permutation DistributedSampler draws from the seed and the epoch) is cut into
micro-batches of b consecutive samples, and rank r reads micro-batches r, r + W, ... . The epoch
is padded (repeating its first samples, as DistributedSampler pads) or, with drop_last, cut to a
whole number of train batches, which is the same at every W.

Random numbers: `micro_batch_rng` seeds the CPU generator (and the device's) from (seed, k, the
forward's index within the micro-batch) for the length of one forward, then restores what was
there, so the rest of the program draws as before.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.utils.data import Sampler

_MASK64 = (1 << 64) - 1


class MicroBatchSampler(Sampler[list[int]]):
    """A batch sampler that gives rank `rank` of `num_replicas` the global micro-batches
    rank, rank + num_replicas, ... of each epoch (see the module docstring).

    Use it as `DataLoader(dataset, batch_sampler=MicroBatchSampler(...))`.

    Args:
        dataset_size: samples in the dataset (`len(dataset)`).
        micro_batch_size: samples per micro-batch (train_micro_batch_size_per_gpu).
        train_batch_size: samples per optimizer step over every rank (the epoch is a whole
            number of these).
        num_replicas, rank: the data-parallel ranks and this one.
        shuffle, seed, drop_last: as DistributedSampler's; `set_epoch` too. `set_start_step`
            starts an epoch at one of its optimizer steps.
    """

    def __init__(
        self,
        dataset_size: int,
        micro_batch_size: int,
        train_batch_size: int,
        num_replicas: int,
        rank: int,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        if train_batch_size % (micro_batch_size * num_replicas):
            raise ValueError(
                f"train_batch_size={train_batch_size}: must be a multiple of micro_batch_size "
                f"({micro_batch_size}) x num_replicas ({num_replicas})."
            )
        if drop_last and dataset_size < train_batch_size:
            raise ValueError(
                f"dataset_size={dataset_size}: with drop_last, an epoch needs at least one train batch "
                f"({train_batch_size} samples)."
            )
        self.dataset_size = dataset_size
        self.micro_batch_size = micro_batch_size
        self.train_batch_size = train_batch_size
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0
        self.start_step = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def set_start_step(self, step: int) -> None:
        """Start the epoch at its optimizer step `step` (a resumed or replayed run), skipping the
        micro-batches of the steps before it."""
        if not 0 <= step * self.train_batch_size < max(1, self._epoch_samples()):
            raise ValueError(f"step={step}: an epoch here has {self._epoch_samples() // self.train_batch_size} steps.")
        self.start_step = step

    def _epoch_samples(self) -> int:
        full, rest = divmod(self.dataset_size, self.train_batch_size)
        return (full if self.drop_last or rest == 0 else full + 1) * self.train_batch_size

    def __len__(self) -> int:
        """Micro-batches this rank reads in the epoch (from its start step)."""
        samples = self._epoch_samples() - self.start_step * self.train_batch_size
        return samples // (self.micro_batch_size * self.num_replicas)

    def __iter__(self) -> Iterator[list[int]]:
        if self.shuffle:
            generator = torch.Generator()
            generator.manual_seed(self.seed + self.epoch)  # DistributedSampler's permutation
            order = torch.randperm(self.dataset_size, generator=generator).tolist()
        else:
            order = list(range(self.dataset_size))
        total = self._epoch_samples()
        while len(order) < total:  # pad with the epoch's first samples
            order += order[: total - len(order)]
        order = order[:total]
        b = self.micro_batch_size
        first = self.start_step * self.train_batch_size // b
        for k in range(first + self.rank, total // b, self.num_replicas):
            yield order[k * b : (k + 1) * b]


def _mix(x: int) -> int:
    """splitmix64's finalizer: nearby inputs give unrelated 64-bit outputs."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def micro_batch_seed(seed: int, micro_batch: int, forward: int = 0) -> int:
    """The seed of global micro-batch `micro_batch`'s `forward`-th forward (63 bits)."""
    return _mix(_mix(_mix(seed) ^ micro_batch) ^ forward) >> 1


@contextlib.contextmanager
def micro_batch_rng(seed: int, device: torch.device) -> Iterator[None]:
    """The CPU generator and `device`'s default generator seeded with `seed` inside the block,
    restored after it."""
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices, device_type=device.type if devices else "cuda"):
        torch.random.default_generator.manual_seed(seed)
        if devices:
            with torch.cuda.device(device):
                torch.cuda.manual_seed(seed)
        yield
