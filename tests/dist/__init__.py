"""Multi-process tests on CPU with gloo, run on pooled workers (see harness.py)."""
