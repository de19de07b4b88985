"""`"zeroshard": {"deterministic_reduction": true}`: the same bits at 1, 2, 4 and 8 ranks.

Each step holds N = W x GAS = 8 micro-batches of 2 rows (so GAS = 8, 4, 2, 1). For stages 0-3 in
fp32 and bf16, 10 AdamW steps with clipping active: the full fp32 masters, both AdamW moments and
every step's grad norm are bitwise equal to W = 1's (zero tolerance: the mode's promise), at W = 2
for the whole grid, at W = 4 for six of its eight cells and at W = 8 for stage 0 and stage 3 in
fp32 (the whole grid at every W is benchmarks/deterministic_reduction.py, kept out of the suite's
time). The first step's reduced gradient is bitwise the tree of the 8 micro-batch gradients
computed here by plain torch (the independent reference: `tree` in tests/dist/scenarios/deterministic.py,
written from the definition in zeroshard/grads/tree_reduce.py's note). Checkpoints saved at W = 4
after step 5 and resumed at W = 2 (stage 1 fp32, stage 3 bf16) and W = 8 (stage 3 bf16) end step 10
bitwise where the uninterrupted W = 4 run does.
The control: the default reduction at W = 4 does not give W = 1's bits (so the comparison can
fail). The wider grid (torch_autocast, fp16, Muon, offload, ...) is benchmarks/deterministic_reduction.py.
"""

from __future__ import annotations

import pytest
import torch

from tests.dist.scenarios.deterministic import reference_micro_batch_gradients, tree

WORLD_SIZES = (1, 2, 4, 8)
MICRO_BATCHES = 8  # W x GAS at every world size
MICRO = 2  # rows per micro-batch
STEPS = 10
STAGES = (0, 1, 2, 3)
MODES = ("fp32", "bf16")
GRID = [{"name": f"s{stage}-{mode}", "stage": stage, "mode": mode} for stage in STAGES for mode in MODES]
# The cases each world size runs (W = 8 costs the most: eight processes on the CI's two cores,
# about 3 s a case on a loaded machine). Stage 0 (the sum gathered into the full gradient buffer)
# and stage 3 (the reduced shards) are the two ends of the reduction's paths; s3-bf16 also runs at
# W = 8 as the resumed case below.
AT_WORLD = {
    1: [spec["name"] for spec in GRID],
    2: [spec["name"] for spec in GRID],
    4: ["s0-bf16", "s1-fp32", "s1-bf16", "s2-fp32", "s2-bf16", "s3-bf16"],
    8: ["s0-fp32", "s3-fp32"],
}
# Saved at W = 4 after step 5; resumed at W = 2 (both) and W = 8 (s3-bf16).
RESUMED = {2: ("s1-fp32", "s3-bf16"), 8: ("s3-bf16",)}
SAVE_AT = 5
CONTROL = {"name": "control-default-s2-fp32", "stage": 2, "mode": "fp32", "deterministic": False}
TIMEOUT_S = 600


@pytest.fixture(scope="module")
def runs(dist_pool, tmp_path_factory):
    """Per world size, the grid's results; W = 4 also saves the resumed cases' checkpoints, which
    W = 2 and W = 8 then load (`resumed`); W = 1 and W = 4 also run the default-mode control."""
    root = tmp_path_factory.mktemp("deterministic")
    save = {name: str(root / name) for name in RESUMED[2] + RESUMED[8]}
    task = "tests.dist.scenarios.deterministic"
    out: dict[int, dict] = {}
    def grid(world: int) -> list[dict]:
        return [spec for spec in GRID if spec["name"] in AT_WORLD[world]]

    grid4 = [dict(spec, save_dir=save[spec["name"]], save_at=SAVE_AT) if spec["name"] in save else spec
             for spec in grid(4)]
    out[4] = dist_pool(4).run(f"{task}:train_cases", grid4 + [CONTROL], timeout=TIMEOUT_S)[0]
    resumed = {}
    for world in (2, 8):
        pool = dist_pool(world)
        out[world] = pool.run(f"{task}:train_cases", grid(world), timeout=TIMEOUT_S)[0]
        resume = [dict(spec, load_dir=save[spec["name"]]) for spec in GRID if spec["name"] in RESUMED[world]]
        resumed[world] = pool.run(f"{task}:resume_cases", resume, timeout=TIMEOUT_S)[0]
    out[1] = dist_pool(1).run(f"{task}:train_cases", grid(1) + [CONTROL], timeout=TIMEOUT_S)[0]
    return out, resumed


def test_the_replay_example(dist_pool, tmp_path) -> None:
    """docs/deterministic-reduction.md's recipe: a step of a 2-process run (dropout on, the engine's
    loader) replayed on one process has the recorded losses, grad norm and parameters, bitwise."""
    task = "tests.dist.scenarios.deterministic:run_example"
    status, printed = dist_pool(2).run(task, "deterministic_replay.py", "--dir", str(tmp_path), "--steps", "2",
                                       timeout=TIMEOUT_S)[0]
    assert status == 0 and printed.count("(world 2)") == 2, printed
    # Step 1 (the second): the replay starts from a checkpoint saved mid-run, not the initial state.
    status, printed = dist_pool(1).run(task, "deterministic_replay.py", "--dir", str(tmp_path), "--replay-step",
                                       "1", timeout=TIMEOUT_S)[0]
    assert printed.count("micro-batch ") == 8, printed
    assert ("losses same bits: True" in printed and "same bits: True, parameters after the step same bits: True"
            in printed and status == 0), printed


def differing(a, b, where: str = "") -> list[str]:
    """Where two nested results differ bitwise (tensors by torch.equal, dtype included)."""
    if isinstance(a, dict):
        return [d for key in a for d in differing(a[key], b[key], f"{where}.{key}")]
    if isinstance(a, (list, tuple)):
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in differing(x, y, f"{where}[{i}]")]
    if isinstance(a, torch.Tensor):
        return [] if a.dtype == b.dtype and torch.equal(a, b) else [where]
    return [] if a == b else [where]


@pytest.mark.parametrize("world_size", (2, 4, 8))
def test_same_bits_at_every_world_size(runs, world_size: int) -> None:
    out, _ = runs
    for name in AT_WORLD[world_size]:
        diff = differing(out[1][name], out[world_size][name])
        assert not diff, f"{name}: W={world_size} differs from W=1 at {diff[:5]}"


def test_the_default_reduction_depends_on_the_world_size(runs) -> None:
    """The control: without the mode, W = 4 and W = 1 end apart (so the test above can fail)."""
    out, _ = runs
    name = CONTROL["name"]
    assert differing(out[1][name]["master"], out[4][name]["master"])


def micro_batch_gradients(mode: str) -> list[dict[str, torch.Tensor]]:
    """Step 1's micro-batch gradients by plain torch, on one thread as the pool's workers run: a
    CPU matmul's summation order depends on the thread count (the mode's docs say so)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return reference_micro_batch_gradients(mode, torch.device("cpu"), MICRO_BATCHES, MICRO)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("mode", MODES)
def test_first_gradient_is_the_tree_of_the_micro_batch_gradients(runs, mode: str) -> None:
    out, _ = runs
    grads = micro_batch_gradients(mode)
    # Each leaf divided by N = 8 (exact: a power of two), then the tree, in fp32.
    expected = {name: tree([g[name] / MICRO_BATCHES for g in grads]) for name in grads[0]}
    for world in WORLD_SIZES:
        for stage in STAGES:
            name = f"s{stage}-{mode}"
            if name not in AT_WORLD[world]:
                continue
            got = out[world][name]["grad0"]
            for name, want in expected.items():
                assert got[name].dtype == torch.float32
                assert torch.equal(got[name], want), f"W={world} stage {stage} {mode}: {name}"


@pytest.mark.parametrize("world_size", (2, 8))
def test_resume_at_another_world_size(runs, world_size: int) -> None:
    out, resumed = runs
    for name in RESUMED[world_size]:
        got = resumed[world_size][name]
        assert got["global_steps"] == STEPS
        # Steps 6-10: each step's grad norm, then the masters and moments after step 10.
        want = out[4][name]
        diff = (differing(want["norms"][SAVE_AT:], got["norms"]) + differing(want["master"], got["master"])
                + differing(want["state"], got["state"]))
        assert not diff, f"{name}: saved at W=4, resumed at W={world_size}: differs at {diff[:5]}"
