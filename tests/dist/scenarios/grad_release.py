"""Rank-side scenario for tests/dist/grads/test_grad_release.py: the reduced gradient freed
after every step (what a GPU engine does, zeroshard/grads/buffers.py's note), forced on CPU."""

from __future__ import annotations

from tests.dist.scenarios.common import Case, build_engine, engine_loop_step, train


def train_released(cases: list[Case]) -> list[dict]:
    """Train each case with every flat's `release_after_step` on; after each step record
    whether any reduced gradient buffer was still held (it must not be)."""
    results = []
    for case in cases:
        engine = build_engine(case)
        for flat in engine.flats:
            flat.grads.release_after_step = True
        held_after_step: list[bool] = []

        def step_fn(engine, case, batch, _held=held_after_step):
            if engine.global_steps > 0:  # the previous step released everything
                _held.append(any(f.grads.reduced is not None or f.grads.reduced_full is not None for f in engine.flats))
            return engine_loop_step(engine, case, batch)

        result = train(engine, case, step_fn=step_fn)
        held_after_step.append(any(f.grads.reduced is not None for f in engine.flats))
        result["held_after_step"] = held_after_step
        results.append(result)
    return results
