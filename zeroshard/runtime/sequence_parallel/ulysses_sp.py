"""DeepSpeed's `deepspeed.runtime.sequence_parallel.ulysses_sp` path: re-exports of
`zeroshard.sequence.ulysses_sp`."""

from zeroshard.sequence.ulysses_sp import (
    SequenceTiledCompute,
    TiledFusedLogitsLoss,
    TiledMLP,
    UlyssesSPAttentionHF,
    UlyssesSPDataLoaderAdapter,
    sequence_tiled_compute,
)

__all__ = [
    "SequenceTiledCompute",
    "TiledFusedLogitsLoss",
    "TiledMLP",
    "UlyssesSPAttentionHF",
    "UlyssesSPDataLoaderAdapter",
    "sequence_tiled_compute",
]
