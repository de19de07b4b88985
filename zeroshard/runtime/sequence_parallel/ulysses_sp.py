"""placeholder"""
from ...sequence.tiled import SequenceTiledCompute, TiledFusedLogitsLoss, TiledMLP, sequence_tiled_compute  # noqa: F401
