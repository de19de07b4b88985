"""DeepSpeed's `deepspeed.utils.logger` and `log_dist` for zeroshard's log: the logger named
"zeroshard" (what the engine, checkpointing and monitors write to), so an integration that sets
DeepSpeed's log level (the Trainer does, from its own `log_level`) sets zeroshard's."""

from __future__ import annotations

import logging
from collections.abc import Iterable

logger = logging.getLogger("zeroshard")


def log_dist(message: str, ranks: Iterable[int] | None = None, level: int = logging.INFO) -> None:
    """DeepSpeed's `log_dist`: without a process group, log as rank -1; with one, log only on the
    ranks listed (`[-1]`: every rank; None or empty: none), prefixed "[Rank r]"."""
    import torch.distributed as dist

    initialized = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if initialized else -1
    ranks = list(ranks or [])
    if not initialized or (ranks and (ranks[0] == -1 or rank in ranks)):
        logger.log(level, f"[Rank {rank}] {message}")
