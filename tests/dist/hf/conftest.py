"""One pool for every Hugging Face integration test here, with the `deepspeed` alias installed
(tests/dist/hf/alias_pool.py): its workers import transformers, Accelerate and TRL once (the
bulk of these tests' time on a 2-core machine), and every test file's tasks run on them in turn.
"""

from __future__ import annotations

import pytest

from tests.dist.hf.alias_pool import alias_pool


@pytest.fixture(scope="session")
def hf_pool(tmp_path_factory):
    """(a DistPool of 2 ranks whose tasks call `use_alias(alias)` first, the alias directory)."""
    with alias_pool(2, tmp_path_factory.mktemp("alias")) as (pool, alias):
        yield pool, alias
