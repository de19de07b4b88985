"""The GPU check's host-sync row (benchmarks/gpu_check/syncs.py) classifies what it records: a sync
is let through only where the allow-list names its innermost zeroshard frame, at most as often as
the list says per step; a sync with no zeroshard frame keeps its whole stack and thread.
The sync debug mode itself needs CUDA; these stacks are built by hand."""

from traceback import FrameSummary

from benchmarks.gpu_check.syncs import ALLOWED, PACKAGE, _record, classify

PKG = PACKAGE  # the installed package's directory, with its trailing separator
STEP = [FrameSummary(PKG.rsplit("zeroshard", 1)[0] + "tests/x.py", 1, "run_steps"),
        FrameSummary(PKG + "engine/engine.py", 441, "step"), FrameSummary(PKG + "step/optimizer_step.py", 139, "run")]


def frame(path: str, line: int, name: str) -> FrameSummary:
    return FrameSummary(PKG + path, line, name)


def test_the_steps_one_read_is_allowed_once_per_step():
    read = STEP + [frame("step/optimizer_step.py", 205, "global_norm")]
    seen = [_record(read, "called a synchronizing CUDA operation") for _ in range(2)]
    problems, places = classify(seen, steps=2)
    assert problems == []
    assert places == ["step/optimizer_step.py:205 global_norm <- step/optimizer_step.py:139 run"
                      " <- engine/engine.py:441 step"]
    assert all(s["allowed"] == "global_norm" for s in seen)
    # A third read in two steps (e.g. a position slot written from a Python number) is one too many.
    problems, _ = classify(seen + [_record(read, "called a synchronizing CUDA operation")], steps=2)
    assert problems == ["global_norm: 3 syncs in 2 steps (allowed 1 per step)"]


def test_a_sync_elsewhere_fails_even_when_called_from_an_allowed_function():
    # The innermost zeroshard frame decides: `run` calling something that syncs is not `global_norm`.
    seen = [_record(STEP, "called a synchronizing CUDA operation")]
    problems, places = classify(seen, steps=2)
    assert problems == ["step/optimizer_step.py:139 run <- engine/engine.py:441 step"]
    assert places == []


def test_a_checkout_named_zeroshard_does_not_make_its_tests_package_frames():
    stack = [FrameSummary("/home/me/zeroshard/tests/dist/scenarios/common.py", 5, "train"),
             FrameSummary("/home/me/zeroshard/benchmarks/gpu_check/syncs.py", 9, "run_steps")]
    assert _record(stack, "called a synchronizing CUDA operation")["place"] == "(no zeroshard frame)"


def test_a_sync_with_no_zeroshard_frame_keeps_its_stack_and_thread():
    stack = [FrameSummary("/repo/benchmarks/gpu_check/syncs.py", 120, "steady_state_syncs"),
             FrameSummary("/usr/lib/python3/site-packages/torch/cuda/__init__.py", 900, "synchronize")]
    seen = [_record(stack, "called a synchronizing CUDA operation\nmore")]
    assert seen[0]["place"] == "(no zeroshard frame)"
    assert seen[0]["thread"] == "MainThread"
    assert seen[0]["stack"][-1].endswith("torch/cuda/__init__.py:900 synchronize")
    problems, _ = classify(seen, steps=2)
    assert len(problems) == 1 and "thread MainThread" in problems[0] and "synchronize" in problems[0]


def test_every_allowed_sync_names_a_real_function_and_a_reason():
    import importlib

    for entry in ALLOWED:
        module = importlib.import_module("zeroshard." + entry.path.removesuffix(".py").replace("/", "."))
        owner = next(v for v in vars(module).values() if isinstance(v, type) and entry.function in vars(v))
        assert callable(getattr(owner, entry.function))
        assert entry.per_step >= 1 and len(entry.reason) > 40
