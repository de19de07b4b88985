"""One flat's gradient buffers: allocated, accumulated into, handed to the reducer, zeroed, freed.

[Note: gradient buffers]
A flat buffer (zeroshard/sharding/flat.py, parameter storage) has one `FlatGradients` beside it,
`flat.grads`, laid out like the flat's parameters:

    local         gradients accumulated on this rank and not yet reduced (full size, in the
                  accumulation dtype; allocated on first use).
    reduced       the reduced (summed over ranks, divided by world_size x grad_accum_steps)
                  gradient for the master's range, in the accumulation dtype.
    reduced_full  stages 0-1 (an all-reduce): the whole reduced gradient, full size, of which
                  `reduced` is the master's range (all of it at stage 0, this rank's shard as a
                  view at stage 1). None at stages 2-3 (a reduce-scatter leaves only the shard).

The walk of a gradient through them: the hook `accumulate`s into `local`; the reducer
(zeroshard/grads/reduce.py) takes it with `begin_reduction` and releases it with
`end_reduction`, and writes its result into `reduced_buffer()` (`reduced_full_buffer()` at
stages 0-1); the step reads `reduced` and calls `clear_reduced`; zero_grad calls `drop`.

[Note: released between steps on an accelerator]
On a GPU the reduced gradient is freed after the step (`release_after_step`), not zeroed and
kept: the next forward's activations can use its memory, and the next backward allocates it
again through the caching allocator, which costs no device time. That is 4 bytes per
parameter (fp32 accumulation) off the peak, which comes at the start of the backward when
the activations are largest (docs/benchmarks.md, the memory accounting against FSDP2). On
the CPU a freed buffer of this size goes back to the operating system and its pages fault in
again next step, so there it is kept and reused.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from zeroshard.sharding.flat import FlatParamGroup


class FlatGradients:
    """The gradient buffers of one flat (the note above)."""

    def __init__(self, flat: FlatParamGroup, release_after_step: bool | None = None) -> None:
        self.flat = flat
        # [Note: released between steps on an accelerator]
        self.release_after_step = (
            flat.device.type != "cpu" if release_after_step is None else release_after_step
        )
        self.local: torch.Tensor | None = None
        # Params whose region of `local` holds no gradient of this accumulation yet (its
        # contents are stale or uninitialised): their first gradient is copied in, not added,
        # so the buffer is never zero-filled up front (see `accumulate`).
        self._unwritten: set[int] = set()
        self.reduced: torch.Tensor | None = None
        self.reduced_full: torch.Tensor | None = None
        # The full local buffer `reduced` lives in, when a reduction ran in place.
        self._reduced_in_local: torch.Tensor | None = None
        # Offload: elements of `reduced` copied to the host landing buffer since it last
        # changed otherwise (zeroshard/sharding/offload.py's HostGradients); anything else that
        # writes it resets this, so the step then moves the whole shard again.
        self.host_landed = 0

    # ------------------------------------------------------------------ local
    def _restart_local(self, buffer: torch.Tensor) -> None:
        """`buffer` becomes the local gradient of a new accumulation: every parameter's region
        counts as unwritten (zeroed lazily); the padding is zeroed now, since it is reduced."""
        flat = self.flat
        buffer.narrow(0, flat.numel, flat.padded_numel - flat.numel).zero_()
        self.local = buffer
        self._unwritten = set(range(len(flat.params)))

    def local_buffer(self) -> torch.Tensor:
        """The full-size local gradient buffer in the accumulation dtype, allocated on first
        use. At stages 2-3 it lives only until the unit is reduced, but it still accumulates
        (no_sync micro-steps, several autograd phases), so it too is in the accumulation
        dtype: summing in the gradient dtype would lose what fp32 accumulation promises.

        Regions no gradient reached yet may hold anything: read it through `settled_local`."""
        if self.local is None:
            flat = self.flat
            self._restart_local(
                torch.empty(flat.padded_numel, dtype=flat.role.grad_accum_dtype, device=flat.device)
            )
        return self.local

    def settled_local(self) -> torch.Tensor:
        """The local gradient with every region no gradient reached set to zero."""
        buf = self.local_buffer()
        flat = self.flat
        for index in self._unwritten:
            buf.narrow(0, flat.offsets[index], flat.numels[index]).zero_()
        self._unwritten.clear()
        return buf

    def holds_unreduced(self) -> bool:
        """Some parameter's gradient is in the local buffer, not reduced yet."""
        return self.local is not None and len(self._unwritten) < len(self.flat.params)

    def accumulate(self, index: int, grad: torch.Tensor) -> None:
        """Add parameter `index`'s gradient into the local buffer."""
        flat = self.flat
        buf = self.local_buffer()
        region = buf.narrow(0, flat.offsets[index], flat.numels[index])
        # The first gradient of an accumulation is copied (cast if need be): one pass over
        # the region instead of a zero fill and an add.
        if index in self._unwritten:
            region.copy_(grad.reshape(-1))
            self._unwritten.discard(index)
        else:
            region.add_(grad.reshape(-1))

    # ---------------------------------------------------------------- reduced
    def reduced_buffer(self) -> torch.Tensor:
        """The reduced gradient of the master's range (zeros when none was reduced yet)."""
        if self.reduced is None:
            flat = self.flat
            dtype = flat.role.grad_accum_dtype
            if flat.policy.scatter:
                self.reduced = torch.zeros(flat.shard_numel, dtype=dtype, device=flat.device)
            else:  # an all-reduce fills the whole buffer; the master reads its range of it
                self.reduced_full = torch.zeros(flat.padded_numel, dtype=dtype, device=flat.device)
                self.reduced = self._master_part(self.reduced_full)
        return self.reduced

    def reduced_full_buffer(self) -> torch.Tensor:
        """Stages 0-1: the whole reduced gradient (what an all-reduce writes)."""
        assert not self.flat.policy.scatter, "a reduce-scatter leaves only the shard"
        self.reduced_buffer()
        assert self.reduced_full is not None
        return self.reduced_full

    def reduced_full_in_local(self) -> torch.Tensor:
        """Stages 0-1 under the deterministic reduction (zeroshard/grads/tree_reduce.py): the
        local buffer, whose values were already sent, becomes the whole reduced gradient (as an
        in-place all-reduce makes it), so no second full buffer exists; returns it for the
        gather to fill. A buffer of another dtype, or none, gives `reduced_full_buffer()`."""
        local = self.local
        if local is None or self.reduced is not None or local.dtype != self.flat.role.grad_accum_dtype:
            return self.reduced_full_buffer()
        self.reduced_full = local
        self.reduced = self._master_part(local)
        self._reduced_in_local = local
        self.local = None
        return local

    def _master_part(self, full: torch.Tensor) -> torch.Tensor:
        flat = self.flat
        return flat.shard_of(full) if flat.policy.shard_optimizer else full

    # -------------------------------------------------------------- reduction
    def begin_reduction(self, allow_in_place: bool = True) -> tuple[torch.Tensor, bool]:
        """Hand the local gradient to the reducer: (the settled local buffer, in place).

        In place when nothing reduced is waiting at stages 0-1: the local buffer becomes the
        whole reduced gradient (`reduced_full`; the master reads its range of it) and the
        reducer's all-reduce writes the result back into it, so those stages keep one full
        gradient buffer, not a second for the result.
        Otherwise the reducer copies the values out, accumulates the result into
        `reduced_buffer()` and calls `end_reduction`.
        """
        local = self.settled_local()
        flat = self.flat
        in_place = (
            allow_in_place
            and self.reduced is None
            and local.dtype == flat.role.grad_accum_dtype
            and not flat.policy.reduce_every_backward
        )
        if in_place:
            self.reduced_full = local
            self.reduced = self._master_part(local)
            self._reduced_in_local = local
            self.local = None
        return local, in_place

    def end_reduction(self) -> None:
        """The local values were copied out for reduction: zero the persistent buffer
        (stages 0-1) or free it (2-3)."""
        if self.local is None:
            return
        if self.flat.policy.reduce_every_backward:
            self.local = None
        else:
            self._restart_local(self.local)

    # ------------------------------------------------------------------ clear
    def drop(self) -> None:
        """Forget every accumulated gradient, local and reduced (zero_grad)."""
        self.flat.master.grad = None
        if self.local is not None:
            self.end_reduction()
        self.clear_reduced()

    def clear_reduced(self) -> None:
        """After a step (or zero_grad): zero the reduced gradient; a buffer that was the local
        one becomes the local one again. Freed instead on an accelerator (the note above)."""
        self.host_landed = 0
        if self.release_after_step:
            self.reduced = self.reduced_full = self._reduced_in_local = None
            return
        if self._reduced_in_local is not None:
            base, self._reduced_in_local, self.reduced = self._reduced_in_local, None, None
            self.reduced_full = None
            if self.local is None:
                self._restart_local(base)  # no zero fill: see `accumulate`
        elif self.reduced_full is not None:
            self.reduced_full.zero_()
        elif self.reduced is not None:
            self.reduced.zero_()
