"""Module-level functions that run on every rank of a `dist_pool` (tests/dist/harness.py).

They build engines, train, and return plain data (losses, norms, full parameters); the
tests in tests/dist/ compare those with each other and with tests/dist/reference.py.
"""
