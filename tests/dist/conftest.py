"""The `dist_pool` fixture: session-wide worker pools, one per world size.

Usage in a test under tests/dist/:

    def test_something(dist_pool):
        results = dist_pool(2).run(my_task, arg, timeout=60)   # one result per rank

To use it from another test directory, import it into that directory's conftest.py:
`from tests.dist.conftest import dist_pool  # noqa: F401`.
"""

import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

# Test modules and worker tasks import `tests.dist.harness`; make the repository root
# importable however pytest was started (its own sys.path insertion is tests/, not the root).
_REPO_ROOT = str(Path(__file__).resolve().parents[2])
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)

from tests.dist.harness import DistPool, close_shared_pools, shared_pool  # noqa: E402


@pytest.fixture(scope="session")
def dist_pool() -> Iterator[Callable[[int], DistPool]]:
    """`dist_pool(world_size)` -> the session's DistPool of that size; all closed at the end."""
    yield shared_pool
    close_shared_pools()
