"""A pool of fresh gloo workers for the Hugging Face integration tests, with the `deepspeed`
alias installed in a temporary directory (zeroshard.tools.deepspeed_alias).

A fresh pool, not the session's shared one: transformers and accelerate look for DeepSpeed when
they are first imported, and another test's task may already have imported them in a shared
worker without the alias (tests/dist/scenarios/hf_common.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from tests.dist.harness import DistPool


@contextlib.contextmanager
def alias_pool(world_size: int, directory: Path) -> Iterator[tuple[DistPool, str]]:
    """(a fresh DistPool of `world_size`, the alias directory to hand to each task)."""
    from zeroshard.tools.deepspeed_alias import install

    install(target=directory)
    pool = DistPool(world_size)
    try:
        yield pool, str(directory)
    finally:
        pool.close()
