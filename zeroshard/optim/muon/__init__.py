"""Muon: orthogonalized momentum for hidden weight matrices, AdamW for everything else.

    optimizer.py      Muon (single process / whole parameters)
    sharded.py        ShardedMuon over the engine's flat master tensors (owner-rank orthogonalization)
    groups.py         which parameters Muon updates, and the engine's split of groups
    settings.py       the optimizer.params keys
    maths.py          momentum, the AdamW part, applying an update
    newton_schulz.py  the Newton-Schulz iterations
"""

from zeroshard.optim.muon.optimizer import Muon, ShardedMuon

__all__ = ["Muon", "ShardedMuon"]
