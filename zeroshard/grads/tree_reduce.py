"""The deterministic reduction: one fixed pairwise tree over every micro-batch of a step.

[Note: the deterministic reduction]
With `"zeroshard": {"deterministic_reduction": true}` a step's gradient is the sum of the
N = W x GAS micro-batch gradients g_0 .. g_{N-1} (global micro-batch k runs on rank k mod W at
micro-step k div W, and each is divided by N), combined by one tree that depends on N only:

    tree(x_0)          = x_0
    tree(x_0 .. x_n-1) = tree(x_0 + x_1, x_2 + x_3, ..., [x_n-1])   (an odd last one carried up)

For W a power of two the first log2(W) levels are whole subtrees of W consecutive micro-batches,
which are one micro-step on every rank. So each micro-step's backward sends every rank its shard
of every rank's gradient (an all-to-all of the bucket's rows, the bytes of a reduce-scatter) and
each rank sums the W rows it received in the tree's order (`pairwise_sum_rows`). The upper levels
combine a rank's micro-step sums, in fp32, by a binary counter (`PairwiseStack`) that builds the
same tree as the steps arrive. So W = 8, GAS = 1 and W = 2, GAS = 4 and W = 1, GAS = 8 perform
the same additions on the same values, and every element of the summed gradient has the same
bits. IEEE addition is commutative (a + b and b + a are the same number) but not associative:
fixing the tree fixes the result. With GAS = 1 any W works (the tree over W rows is tree(N)).

Every level adds in fp32 (or the accumulation dtype if wider), so no level rounds differently at
another W; the total is cast to the accumulation dtype once. A narrower wire dtype
(communication_data_type) rounds each leaf once, at every W (W = 1 too: the all-to-all of a
group of one copies the staged, cast rows). The leaves are whole micro-batches: a gradient that
reaches a unit after the unit was reduced in the same backward (a late gradient, which the
default reduction adds) would be a second leaf, so it is an error here, as is a step whose
backward count is not GAS.

The global norm follows the same idea (zeroshard/step/optimizer_step.py): shards are cut at
multiples of NORM_BLOCK_NUMEL elements (`ShardingSpec.shard_align`), each block's sum of
squares is a fixed tree of elementwise additions (`block_square_sums`), and the block sums are
combined by the tree over block index, which trailing zero blocks of padding (more of them at a
larger W) do not change (x + 0 == x). The cut also puts every element at the same offset,
modulo any vector width, within its shard at every W: torch's fused CPU Adam (offload) rounds a
tensor's tail elements, outside its vector loop, differently from the rest.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from zeroshard.comm import collectives as comm
from zeroshard.grads.reduce import GradientReducer
from zeroshard.sharding.flat import FlatParamGroup
from zeroshard.sharding.gather import GatherPiece, all_gather_shards
from zeroshard.sharding.streams import COMPUTE, NULL_STREAMS, REDUCE, StreamSet

# Elements per block of the deterministic norm, and the multiple every shard's size is cut at
# (so no block straddles two ranks). A power of two: the blocks halve evenly. Padding costs up to
# W x 4096 elements per flat; the norm's all-reduce carries one fp32 per 4096 elements.
NORM_BLOCK_NUMEL = 4096


def tree_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype every level of the tree adds in: fp32, or `dtype` if wider."""
    return torch.promote_types(dtype, torch.float32)


def pairwise_sum_rows(rows: torch.Tensor) -> torch.Tensor:
    """tree(rows[0], ..., rows[n-1]) over the first dimension, summed in place in `rows`
    (a view of the total is returned; its shape is rows.shape[1:])."""
    while rows.shape[0] > 1 and rows.shape[0] % 2 == 0:  # one strided add per level
        rows = rows[0::2].add_(rows[1::2])
    level = list(rows.unbind(0))
    while len(level) > 1:  # an odd level: the last one is carried up
        carried = level[-1:] if len(level) % 2 else []
        level = [level[i].add_(level[i + 1]) for i in range(0, len(level) - 1, 2)] + carried
    return level[0]


def pairwise_sum(values: torch.Tensor) -> torch.Tensor:
    """tree(values) of a 1-D tensor, as a 0-d tensor. Zeros appended at the end change no level
    of the tree (x + 0 == x, 0 + 0 == 0), so the values are padded to a power of two and halved
    by strided adds: log2(n) operations, however many values."""
    n = values.numel()
    if n == 0:
        return values.new_zeros(())
    padded = values.new_zeros(1 << (n - 1).bit_length())
    padded[:n] = values
    return pairwise_sum_rows(padded)


class PairwiseStack:
    """tree(x_0, x_1, ...) of tensors pushed one at a time: a binary counter that adds two
    partial sums of the same level as soon as both exist (older + newer, into the older), so it
    holds at most log2(count) + 1 of them. `total()` folds what is left, newest first, which is
    the tree's carrying of odd elements: the same additions as `pairwise_sum_rows`."""

    def __init__(self) -> None:
        self._stack: list[tuple[int, torch.Tensor]] = []
        self.count = 0

    def push(self, x: torch.Tensor) -> None:
        level = 0
        while self._stack and self._stack[-1][0] == level:
            _, older = self._stack.pop()
            x = older.add_(x)
            level += 1
        self._stack.append((level, x))
        self.count += 1

    def total(self) -> torch.Tensor:
        """tree() of everything pushed; the stack starts again empty."""
        assert self._stack, "PairwiseStack.total() of nothing"
        _, x = self._stack.pop()
        while self._stack:
            _, older = self._stack.pop()
            x = older.add_(x)
        self.count = 0
        return x

    def clear(self) -> None:
        self._stack.clear()
        self.count = 0


def block_square_sums(shard: torch.Tensor, block: int = NORM_BLOCK_NUMEL) -> torch.Tensor:
    """The sum of squares of each `block`-element block of `shard` (its numel a multiple of
    `block`), in fp32: each by halving (the block's first half plus its second, until one element
    is left). Only elementwise operations, so a block gives the same bits wherever it sits, on any
    device and thread count (a reduction kernel picks its order by shape and threads)."""
    x = shard.reshape(-1, block).float()
    x = x * x  # a new tensor: the halving below adds in place, into its first halves
    width = block
    while width > 1:
        width //= 2
        x[:, :width].add_(x[:, width : 2 * width])
    return x[:, 0].clone()


class TreeReducer(GradientReducer):
    """The deterministic reduction ([Note: the deterministic reduction] above). Every synced
    backward reduces, whatever the stage: each bucket by an all-to-all of its rows and an ordered
    sum of the rows received; each flat's micro-step sums are combined over the accumulation by a
    `PairwiseStack` and folded into the flat's reduced gradient at the end of the boundary
    backward (stages 0-1 then all-gather it, so the whole reduced gradient is on every rank).

    Args (besides GradientReducer's):
        is_final: whether the running backward ends the accumulation.
        accumulation_steps: returns gradient_accumulation_steps (the leaves a step holds per rank).
    """

    reduces_every_backward = True

    def __init__(
        self,
        flats: list[FlatParamGroup],
        divisor: Callable[[], int],
        bucket_numel: int,
        is_final: Callable[[], bool],
        accumulation_steps: Callable[[], int],
        landing: Callable[[FlatParamGroup, int, int], None] | None = None,
        streams: StreamSet = NULL_STREAMS,
    ) -> None:
        super().__init__(flats, divisor, bucket_numel, landing=landing, streams=streams)
        self._flats = flats
        self._is_final = is_final
        self._accumulation_steps = accumulation_steps
        self._step_sums: dict[int, torch.Tensor] = {}  # this backward's sum, per flat (fp32 shard)
        self._stacks: dict[int, PairwiseStack] = {id(flat): PairwiseStack() for flat in flats}

    # ------------------------------------------------------------------- add
    def _add(self, flat: FlatParamGroup) -> None:
        if id(flat) in self._step_sums:
            raise RuntimeError(
                f"zeroshard.deterministic_reduction: unit '{flat.unit_name}' received a gradient after it was "
                "reduced in this backward (a parameter used again after its unit's backward: shared with another "
                "unit, or by a reentrant checkpoint), which would be a second leaf of the summation tree. Put "
                "the modules that share it in one unit (zeroshard.unit_module_classes), or turn "
                "deterministic_reduction off."
            )
        self._step_sums[id(flat)] = torch.empty(
            flat.shard_numel, dtype=tree_dtype(flat.role.grad_accum_dtype), device=flat.device
        )
        super()._add(flat)

    def _take_local(self, flat: FlatParamGroup) -> tuple[torch.Tensor, bool]:
        # Never in place: stages 0-1 keep their local buffer for the next micro-step.
        return flat.grads.begin_reduction(allow_in_place=False)

    # --------------------------------------------------------------- reduce
    def _issue(self, key: tuple) -> None:
        self._complete_issued()
        bucket = self._open.pop(key)
        bucket.spec = spec = self._specs[key]
        rows = bucket.staging[:, : bucket.used]
        if bucket.used < bucket.capacity:
            rows = rows.contiguous()  # row r (what rank r receives) contiguous
        # Allocated on the compute stream, alive until compute waits on the reduction, as the
        # default reducer's buffers are ([Note: streams and events]).
        # Row r: rank r's values of this rank's columns (a group of one: the rows themselves).
        received = torch.empty_like(rows) if spec.shard.size > 1 else rows
        self._issued_count += 1
        bucket.label = f"bucket-{self._issued_count}"
        streams = self.streams
        produced = streams.record(COMPUTE, f"produced:{bucket.label}")
        with streams.on(REDUCE):
            streams.wait(REDUCE, produced)
            if spec.shard.size > 1:
                bucket.work = comm.all_to_all_single(received, rows, group=spec.shard, tag="grad", async_op=True)
        bucket.staging, bucket.result = rows, received
        self._issued.append(bucket)

    def _complete_issued(self) -> None:
        issued, self._issued = self._issued, []
        streams = self.streams
        for bucket in issued:
            with streams.on(REDUCE):
                if bucket.work is not None:
                    bucket.work.wait()
                rows = bucket.result
                if rows.dtype != tree_dtype(rows.dtype):
                    rows = rows.to(tree_dtype(rows.dtype))  # a narrower wire dtype: the leaves widen
                summed = pairwise_sum_rows(rows)  # this rank's columns, summed over the ranks
                reduced = streams.record(REDUCE, f"reduced:{bucket.label}")
            streams.wait(COMPUTE, reduced)
            for piece in bucket.pieces:
                target = self._step_sums[id(piece.flat)]
                target[piece.c0 : piece.c1].copy_(summed[piece.offset : piece.offset + piece.c1 - piece.c0])

    def finish(self) -> None:
        """Reduce what is left of this backward, stack each flat's micro-step sum, and at the end
        of the accumulation fold the stacks into the reduced gradients."""
        super().finish()
        for flat in self._flats:
            step_sum = self._step_sums.pop(id(flat), None)
            if step_sum is not None:
                self._stacks[id(flat)].push(step_sum)
        if self._is_final():
            self._fold()

    def _fold(self) -> None:
        expected = self._accumulation_steps()
        for flat in self._flats:
            stack = self._stacks[id(flat)]
            if stack.count != expected:
                count = stack.count
                self.drop_accumulated()
                raise RuntimeError(
                    f"zeroshard.deterministic_reduction: {count} micro-batch gradient(s) reduced in this optimizer "
                    f"step (since the last step or zero_grad), but gradient_accumulation_steps is {expected}: the "
                    "summation tree needs one backward per micro-batch and gradient_accumulation_steps of them per "
                    "step. Call engine.backward once per micro-batch and engine.step() after each (a resumed run "
                    "starts at an accumulation boundary)."
                )
            total = stack.total()
            grads = flat.grads
            if flat.policy.scatter:
                grads.reduced_buffer().copy_(total)
            else:
                # Stages 0-1: every rank holds the whole reduced gradient (param.grad's views, stage
                # 0's full master), gathered in the accumulation dtype into the local buffer, whose
                # values were sent at the last micro-step: this rank's sum is cast into its slot and
                # the gather fills the rest in place (one collective per flat, no staging buffer).
                full = grads.reduced_full_in_local()
                all_gather_shards([GatherPiece(total, full, in_place=True)], group=flat.spec.shard, tag="grad").wait()
            if self.landing is not None and flat.policy.shard_optimizer:
                self.landing(flat, 0, flat.shard_numel)

    def drop_accumulated(self) -> None:
        """zero_grad() (or a refused step): forget this accumulation's partial sums."""
        for stack in self._stacks.values():
            stack.clear()
        self._step_sums.clear()
