"""DeepSpeed's batch-size rules: the data-parallel world (world / sequence-parallel size) and
the triangle `train_batch_size = micro batch x gradient_accumulation_steps x data-parallel
world`, any two of which give the third. Part of the one resolve pass (schema.py's
`_check_config` calls them); every problem is recorded, none raised here."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from zeroshard.config.schema import ZeroshardConfig

BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def data_parallel_size(
    cfg: ZeroshardConfig, data: dict, world_size: int, given_sp: int | None, problems: list[str]
) -> int:
    """The data-parallel world (world / sequence-parallel size); records the problems."""
    sp = cfg.sequence_parallel_size
    if given_sp is not None and given_sp != sp:
        if "sequence_parallel_size" in data:
            problems.append(
                f"sequence_parallel_size={sp}: the sequence-parallel groups given (mpu) have {given_sp} ranks. "
                "Make them agree, or drop the key."
            )
        sp = given_sp
        cfg.__dict__["sequence_parallel_size"] = sp
    if world_size % sp:
        problems.append(
            f"sequence_parallel_size={sp}: must divide the world size {world_size}. "
            "Launch a multiple of it ranks, or pick a divisor."
        )
        return world_size
    dp = world_size // sp
    if cfg.data_parallel_size is not None and cfg.data_parallel_size != dp:
        problems.append(
            f"data_parallel_size={cfg.data_parallel_size}: must be world size {world_size} / "
            f"sequence_parallel_size {sp} = {dp}. Fix one of them, or drop data_parallel_size and it will be derived."
        )
    cfg.__dict__["data_parallel_size"] = dp
    return dp


# Accelerate (and so the Trainer) counts one process on a machine without GPUs unless told it is
# a CPU run, while torchrun's processes form a group of several: it then writes train_batch_size
# for a world of one. Real DeepSpeed refuses the same config (docs/hf-trainer.md).
_ONE_PROCESS_HINT = (
    " train_batch_size is the value for 1 process: if the Hugging Face Trainer or Accelerate filled it in "
    "on a machine without GPUs, pass use_cpu=True (--use_cpu, or ACCELERATE_USE_CPU=1) so that they count "
    "every process."
)


def resolve_batch_triangle(cfg: ZeroshardConfig, world_size: int) -> list[str]:
    """Apply DeepSpeed's rule: any two of the three batch keys give the third.

    Returns the problems found (empty if consistent); fills the three fields in ``cfg``.
    """
    train, micro, accum = cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps
    derived: list[str] = []
    defaults: list[str] = []
    if train is not None and micro is not None and accum is not None:
        if train != micro * accum * world_size:
            return [
                f"train_batch_size={train} != train_micro_batch_size_per_gpu ({micro}) * "
                f"gradient_accumulation_steps ({accum}) * world_size ({world_size}) = "
                f"{micro * accum * world_size}. Fix one of them, or drop one key and it will be derived."
                + (_ONE_PROCESS_HINT if world_size > 1 and train == micro * accum else "")
            ]
    elif train is not None and micro is not None:
        if train % (micro * world_size):
            return [
                f"train_batch_size={train} is not divisible by train_micro_batch_size_per_gpu ({micro}) "
                f"* world_size ({world_size}) = {micro * world_size}, so gradient_accumulation_steps "
                "cannot be derived. Fix one of them, or give gradient_accumulation_steps instead."
            ]
        accum = train // (micro * world_size)
        derived.append("gradient_accumulation_steps")
    elif train is not None and accum is not None:
        if train % (accum * world_size):
            return [
                f"train_batch_size={train} is not divisible by gradient_accumulation_steps ({accum}) "
                f"* world_size ({world_size}) = {accum * world_size}, so train_micro_batch_size_per_gpu "
                "cannot be derived. Fix one of them, or give train_micro_batch_size_per_gpu instead."
            ]
        micro = train // (accum * world_size)
        derived.append("train_micro_batch_size_per_gpu")
    elif train is not None:
        accum = 1
        defaults.append("gradient_accumulation_steps")
        if train % world_size:
            return [
                f"train_batch_size={train} is not divisible by world_size ({world_size}), so "
                "train_micro_batch_size_per_gpu cannot be derived. Make it a multiple of the world size."
            ]
        micro = train // world_size
        derived.append("train_micro_batch_size_per_gpu")
    else:
        if micro is None:
            micro = 1
            defaults.append("train_micro_batch_size_per_gpu")
        if accum is None:
            accum = 1
            defaults.append("gradient_accumulation_steps")
        train = micro * accum * world_size
        derived.append("train_batch_size")
    cfg.__dict__.update(
        train_batch_size=train, train_micro_batch_size_per_gpu=micro, gradient_accumulation_steps=accum
    )  # the config is frozen for its readers; this pass is its one writer
    cfg._derived_keys.extend(derived)
    cfg._defaults_applied[:0] = defaults
    return []


