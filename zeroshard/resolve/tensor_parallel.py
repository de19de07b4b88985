"""The resolve pass's rules for `tensor_parallel` (AutoTP) across sections: what it is combined
with. Each problem names the keys as written; `explain` and `initialize` refuse the same
configs (docs/tensor-parallel.md, "What it does not combine with").

The model-dependent checks (which layers split, head counts) run against the model at
`initialize` (zeroshard/autotp/plan.py) and in `explain --model`.
"""

from __future__ import annotations

from zeroshard.config.base import canonical_dtype_name
from zeroshard.config.schema import ZeroshardConfig

__all__ = ["tensor_parallel_problems"]


def tensor_parallel_problems(cfg: ZeroshardConfig, world_size: int, mode: str | None) -> list[str]:
    """Every reason the config's tensor parallelism cannot run on `world_size` ranks in
    precision mode `mode` ("fp32", "bf16", "fp16", "torch_autocast"; None: unresolved)."""
    tp = cfg.tensor_parallel
    size = tp.size
    if size <= 1:
        return []
    at = f"tensor_parallel.autotp_size={size}"
    problems = []
    if world_size % size:
        problems.append(f"{at}: must divide the world size {world_size} (tensor-parallel groups are blocks of "
                        "autotp_size consecutive ranks). Pick a divisor of the number of ranks.")
    if cfg.sequence_parallel_size > 1:
        problems.append(f"{at} with sequence_parallel_size={cfg.sequence_parallel_size}: tensor and sequence "
                        "(Ulysses) parallelism together are not supported by zeroshard (DeepSpeed 0.19.8 refuses "
                        "them together too when folding experts). Use one of them.")
    if cfg.expert_parallel.enabled:
        problems.append(f"{at} with expert_parallel.enabled: AutoEP with AutoTP (DeepSpeed's folding of experts "
                        "over the tensor ranks) is not supported by zeroshard. Use one of them.")
    if cfg.zeroshard.shard_group_size is not None:
        problems.append(f"{at} with zeroshard.shard_group_size={cfg.zeroshard.shard_group_size}: hybrid sharding "
                        "with tensor parallelism is not supported. Remove one of them.")
    if cfg.zeroshard.fp8.enabled:
        problems.append(f"{at} with zeroshard.fp8.enabled: fp8 compute swaps whole nn.Linear layers for torchao's; "
                        "the split layers are not swapped, so fp8 with tensor parallelism is not supported. Use one "
                        "of them.")
    if cfg.optimizer is not None and cfg.optimizer.type.lower() == "muon":
        problems.append(f"{at} with optimizer.type={cfg.optimizer.type!r}: Muon orthogonalises whole matrices and "
                        "each rank holds a slice of every split one; gathering them over the tensor group is not "
                        "built. Use AdamW, or autotp_size 1.")
    if tp.dtype is not None and mode is not None:
        wanted = canonical_dtype_name(tp.dtype)
        trains = {"torch_autocast": "fp32"}.get(mode, mode)
        if wanted != trains:
            problems.append(f"tensor_parallel.dtype={tp.dtype!r}: the config trains in {mode} (bf16/fp16 sections). "
                            "Make them agree, or remove tensor_parallel.dtype.")
    return problems
