"""The collectives of one optimizer step: their ops, dtypes and byte counts (docs/design.md sections 2 and 5).

`zeroshard.comm.recording()` is held around one step (forward of the first micro-step to
the boundary `engine.step()`). The expected records are derived here from the model's
structure and the precision contract, not read from the engine:

- flat buffers: one per unit and precision group. Units (reference.py): the root unit
  (332 elements) and three blocks (304 each). Under torch_autocast each unit splits into
  its Linear parameters ("safe": root 91 = odd 40 + unused 51, block 272) and the rest
  ("other": root 241 = tied embedding 208 + LayerNorm 32 + gain 1, block 32). Each flat
  is padded to a multiple of the world size.
- "grad" records: stages 0-1 all-reduce (stage 1 keeps the whole reduced gradient for
  `param.grad`), stages 2-3 reduce-scatter, once per step at stages 0-1 and once per
  micro-step at stages 2-3, in the reduce dtype of the contract (table
  `REDUCE`). Flats of one reduce dtype share buckets: each flat is a (W, padded / W)
  matrix and a bucket holds at most reduce_bucket_size // W of those columns, filled in
  reduce order and cut across flats, so one reduction issues ceil(columns / capacity)
  collectives per dtype (one with the default bucket of 5e8).
- "param" records: stages 1-2 all-gather every rank's master shards once after the step in
  the parameter dtype, in buckets cut like the reduce buckets (allgather_bucket_size); stage 3
  all-gathers each flat before its forward and again before its backward,
  in the gather dtype, every micro-step (stage3_param_persistence_threshold 0 here).
- one "norm" all-reduce of 2 + 3W fp32 elements (the norm, and per rank: whether its own
  gradient was finite, its step counter, its training forwards in the step; and the count of
  ranks asked to stop by a preemption signal; zeroshard/step/optimizer_step.py).

Volume. We count what a ring algorithm moves, in units of the buffer: an all-reduce moves
2x its buffer's bytes (a reduce-scatter then an all-gather), a reduce-scatter or an
all-gather 1x (each rank sends (W-1)/W of that; the factor is common to all stages). The
recorder's `bytes` is the full buffer (numel x element size), so

    volume = 2 * sum(all_reduce bytes) + sum(reduce_scatter bytes) + sum(all_gather bytes)

over the "grad" and "param" records. With P the padded element count and b the bytes per
element (4 in fp32): stages 0 and 2 move 2 P b per step, stages 1 and 3 move 3 P b.
"""

from __future__ import annotations

from collections import Counter

import pytest

from tests.dist.reference import BLOCK_LINEAR_NUMEL, BLOCK_NUMEL, N_BLOCKS, ROOT_LINEAR_NUMEL, ROOT_UNIT_NUMEL
from tests.dist.scenarios.comm import record_one_step
from tests.dist.scenarios.common import Case

STAGES = (0, 1, 2, 3)
TIMEOUT_S = 600
COMM_MODES = (
    "fp32",
    "bf16",
    "bf16_comm_bf16",
    "bf16_accum_bf16",
    "fp16",
    "fp16_accum_fp16",
    "autocast_bf16",
    # Combinations DeepSpeed accepts (reference.LOSSY_MODES): the wire carries what they ask for.
    "fp32_accum_bf16",
    "fp32_comm_bf16",
    "fp32_comm_fp16",
    "bf16_autocast",
    "autocast_comm_bf16",
)
TWO_GROUP_MODES = ("autocast_bf16", "autocast_comm_bf16")  # torch_autocast: safe and other groups
ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}
DEFAULT_BUCKET = 500_000_000  # zero_optimization.reduce_bucket_size
SMALL_BUCKET = 500  # reduce and all-gather buckets smaller than the model (1244 elements)

# The precision contract (docs/design.md section 2), per mode and precision group.
REDUCE = {
    ("fp32", "all"): "float32",
    ("bf16", "all"): "float32",  # fp32 accumulation by default, reduced in it
    ("bf16_comm_bf16", "all"): "bfloat16",  # communication_data_type bf16
    ("bf16_accum_bf16", "all"): "bfloat16",  # grad_accum_dtype bf16 (DeepSpeed's default)
    ("fp16", "all"): "float32",
    ("fp16_accum_fp16", "all"): "float16",
    ("autocast_bf16", "safe"): "bfloat16",  # lower_precision_safe_modules: the Linears
    ("autocast_bf16", "other"): "float32",
    ("fp32_accum_bf16", "all"): "bfloat16",  # reduced in the (narrower) accumulation dtype
    ("fp32_comm_bf16", "all"): "bfloat16",
    ("fp32_comm_fp16", "all"): "float16",
    ("bf16_autocast", "all"): "float32",  # bf16 parameters, fp32 accumulation by default
    ("autocast_comm_bf16", "safe"): "bfloat16",
    ("autocast_comm_bf16", "other"): "bfloat16",  # communication_data_type applies to every group
}
PARAM = {
    "fp32": "float32",
    "bf16": "bfloat16",
    "bf16_comm_bf16": "bfloat16",
    "bf16_accum_bf16": "bfloat16",
    "fp16": "float16",
    "fp16_accum_fp16": "float16",
    "autocast_bf16": "float32",
    "fp32_accum_bf16": "float32",
    "fp32_comm_bf16": "float32",
    "fp32_comm_fp16": "float32",
    "bf16_autocast": "bfloat16",
    "autocast_comm_bf16": "float32",
}


def gather_dtype(mode: str, group: str) -> str:
    """Stage-3 gather dtype: the parameter dtype, or the autocast dtype for safe modules."""
    return "bfloat16" if mode in TWO_GROUP_MODES and group == "safe" else PARAM[mode]


def flats(mode: str) -> list[tuple[str, int]]:
    """(precision group, element count) of every flat buffer of the test model."""
    if mode not in TWO_GROUP_MODES:
        return [("all", ROOT_UNIT_NUMEL)] + [("all", BLOCK_NUMEL)] * N_BLOCKS
    root = [("safe", ROOT_LINEAR_NUMEL), ("other", ROOT_UNIT_NUMEL - ROOT_LINEAR_NUMEL)]
    block = [("safe", BLOCK_LINEAR_NUMEL), ("other", BLOCK_NUMEL - BLOCK_LINEAR_NUMEL)]
    return root + block * N_BLOCKS


def padded(numel: int, world_size: int) -> int:
    return -(-numel // world_size) * world_size


def bucket_sizes(columns: int, rows: int, bucket: int) -> list[int]:
    """Elements of each collective that reduces `columns` columns of `rows` rows."""
    capacity = bucket // rows
    sizes = [capacity] * (columns // capacity) + ([columns % capacity] if columns % capacity else [])
    return [rows * cols for cols in sizes]


def expected_records(mode: str, stage: int, world_size: int, ga: int, bucket: int = DEFAULT_BUCKET) -> Counter:
    """The multiset of (op, dtype, numel, tag) one optimizer step must issue."""
    records: Counter = Counter()
    reductions = ga if stage >= 2 else 1
    reduce_op = "all_reduce" if stage <= 1 else "reduce_scatter"
    rows = world_size
    columns: Counter = Counter()  # per reduce dtype
    for group, numel in flats(mode):
        columns[REDUCE[(mode, group)]] += padded(numel, world_size) // rows
    for dtype, cols in columns.items():
        for size in bucket_sizes(cols, rows, bucket):
            records[(reduce_op, dtype, size, "grad")] += reductions
    if stage in (1, 2):  # one parameter dtype per mode: all flats share the gather buckets
        total_columns = sum(padded(numel, world_size) // rows for _, numel in flats(mode))
        for size in bucket_sizes(total_columns, rows, bucket):
            records[("all_gather", PARAM[mode], size, "param")] += 1
    for group, numel in flats(mode):
        size = padded(numel, world_size)
        if stage == 3:
            records[("all_gather", gather_dtype(mode, group), size, "param")] += 2 * ga
    records[("all_reduce", "float32", 2 + 3 * world_size, "norm")] += 1
    return records


def volume(records: list[tuple[str, str, int, int, str]]) -> int:
    """Ring-equivalent bytes of the gradient and parameter collectives (module docstring)."""
    weight = {"all_reduce": 2, "reduce_scatter": 1, "all_gather": 1}
    return sum(weight[op] * nbytes for op, _, _, nbytes, tag in records if tag in ("grad", "param"))


def expected_volume(mode: str, stage: int, world_size: int) -> int:
    total = 0
    for group, numel in flats(mode):
        size = padded(numel, world_size)
        reduce_bytes = ITEMSIZE[REDUCE[(mode, group)]]
        if stage == 0:
            total += 2 * size * reduce_bytes
        elif stage == 1:  # an all-reduce, then the parameter all-gather
            total += size * (2 * reduce_bytes + ITEMSIZE[PARAM[mode]])
        elif stage == 2:
            total += size * (reduce_bytes + ITEMSIZE[PARAM[mode]])
        else:
            total += size * (reduce_bytes + 2 * ITEMSIZE[gather_dtype(mode, group)])
    return total


@pytest.fixture(scope="module")
def recorded(dist_pool):
    """`recorded(world_size, ga, bucket)` -> {(mode, stage): records}; each runs once."""
    cache: dict[tuple[int, int, int], dict] = {}

    def get(world_size: int, ga: int, bucket: int = DEFAULT_BUCKET):
        if (world_size, ga, bucket) not in cache:
            extra = {"zero_optimization": {"reduce_bucket_size": bucket, "allgather_bucket_size": bucket}}
            cases = [
                Case(stage=stage, mode=mode, ga=ga, keep=(), extra=extra) for mode in COMM_MODES for stage in STAGES
            ]
            per_rank = dist_pool(world_size).run(record_one_step, cases, timeout=TIMEOUT_S)
            for rank, results in enumerate(per_rank[1:], start=1):
                assert results == per_rank[0], f"rank {rank} issued other collectives than rank 0"
            cache[(world_size, ga, bucket)] = {
                (c.mode, c.stage): r for c, r in zip(cases, per_rank[0], strict=True)
            }
        return cache[(world_size, ga, bucket)]

    return get


@pytest.mark.parametrize(
    ("world_size", "ga", "bucket"),
    [(2, 1, DEFAULT_BUCKET), (2, 4, DEFAULT_BUCKET), (3, 1, DEFAULT_BUCKET), (3, 4, DEFAULT_BUCKET),
     (2, 1, SMALL_BUCKET), (3, 4, SMALL_BUCKET)],
)
def test_collectives_have_the_contract_dtypes(recorded, world_size: int, ga: int, bucket: int) -> None:
    """Every collective of a step, by op, dtype, size and purpose, is what the contract, the
    stage and the bucket size imply; nothing else is issued (no start-up broadcasts, no
    extra gathers)."""
    results = recorded(world_size, ga, bucket)
    failures = []
    for (mode, stage), records in results.items():
        got = Counter((op, dtype, numel, tag) for op, dtype, numel, _, tag in records)
        want = expected_records(mode, stage, world_size, ga, bucket)
        if got != want:
            failures.append(f"{mode} stage {stage}: missing {dict(want - got)}, unexpected {dict(got - want)}")
        for op, dtype, numel, nbytes, tag in records:
            if nbytes != numel * ITEMSIZE[dtype]:
                failures.append(f"{mode} stage {stage}: {op} {tag} of {numel} {dtype} recorded {nbytes} bytes")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("world_size", [2, 3])
def test_step_volume_is_the_stage_theory(recorded, world_size: int) -> None:
    """One step (k = 1) moves 2 P b bytes at stages 0 and 2, 3 P b at stages 1 (all-reduce
    and all-gather) and 3 (module docstring). In fp32: P = 1244 on 2 ranks (every unit's size
    is even), 1251 on 3 (332 -> 333, 304 -> 306), so 9952 / 14928 and 10008 / 15012 bytes."""
    results = recorded(world_size, 1)
    fp32 = {stage: volume(results[("fp32", stage)]) for stage in STAGES}
    if world_size == 2:
        assert fp32 == {0: 9952, 1: 14928, 2: 9952, 3: 14928}
    else:
        assert fp32 == {0: 10008, 1: 15012, 2: 10008, 3: 15012}
    for (mode, stage), records in results.items():
        assert volume(records) == expected_volume(mode, stage, world_size), (mode, stage)


def test_bf16_communication_halves_the_reduce_bytes(recorded) -> None:
    """communication_data_type bf16 halves the gradient bytes of the default bf16 plan
    (fp32 reduction), and leaves the parameter gathers alone."""
    results = recorded(2, 1)

    def tagged_bytes(mode: str, stage: int, tag: str) -> int:
        return sum(nbytes for _, _, _, nbytes, record_tag in results[(mode, stage)] if record_tag == tag)

    for stage in STAGES:
        assert 2 * tagged_bytes("bf16_comm_bf16", stage, "grad") == tagged_bytes("bf16", stage, "grad")
        assert tagged_bytes("bf16_comm_bf16", stage, "param") == tagged_bytes("bf16", stage, "param")
