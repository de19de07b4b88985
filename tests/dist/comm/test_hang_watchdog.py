"""No silent hangs (issue 37; docs/reliability.md, "No hang past the timeout").

Training loops that stop the ranks moving together as users' loops do. On main each of the
first four killed both processes with a gloo SIGABRT ("Received data size doesn't match
expected size") and no Python error; the others hung until the collective timeout. Now every
rank raises HangError within hang_timeout_s + 15 s of the divergence, with the same diagnosis
text on every rank, naming the collective where the ranks' sequences part, its unit, and the
likely cause. The divergences are deadlocks, named within a few ticks; the stuck data loader is
named after its hang_timeout_s of 3 s (tests/dist/scenarios/hangs.py; collective timeout 30 s).

The SIGKILL and SIGSTOP cases need real processes: tests/dist/comm/test_fault_injection.py.
"""

from __future__ import annotations

import re
from pathlib import Path

from tests.dist.harness import discard_workers
from tests.dist.scenarios.hangs import (
    DEADLOCK_HANG_TIMEOUT_S,
    HANG_TIMEOUT_S,
    data_loader_sleeps,
    moe_zero_tokens,
    parameter_on_one_rank,
    short_then_save,
    skip_step,
    unequal_micro_batches,
)

REPO_ROOT = Path(__file__).resolve().parents[3]
# The bound: every rank ends within the hang timeout plus 15 s of the divergence. A
# deadlock needs no timeout: it must come well before the one it runs with.
LIMIT_S = HANG_TIMEOUT_S + 15
DEADLOCK_LIMIT_S = DEADLOCK_HANG_TIMEOUT_S


def _diagnosed_on_every_rank(outcomes: list[dict], limit_s: float = DEADLOCK_LIMIT_S) -> str:
    """Every rank raised HangError within `limit_s` of the divergence, with the same diagnosis;
    returns it."""
    for rank, outcome in enumerate(outcomes):
        assert outcome["type"] == "HangError", (rank, outcome)
        assert outcome["seconds"] < limit_s, (rank, outcome["seconds"], outcome["diagnosis"])
    texts = {outcome["diagnosis"] for outcome in outcomes}
    assert len(texts) == 1, texts
    return texts.pop()


def test_a_rank_that_skips_step_at_stage_2(dist_pool) -> None:
    """Rank 1 skips one step() (2 ranks, stage 2): its next backward's reduce-scatter against
    rank 0's norm all-reduce aborted both processes before."""
    text = _diagnosed_on_every_rank(dist_pool(2).run(skip_step, 2, 1, timeout=120))
    assert "rank 0: waits" in text and "all_reduce 'norm'" in text, text
    assert "reduce_scatter 'grad'" in text and "unit '<root>'" in text, text
    assert "likely cause: rank 1 ran a backward of step 1 where rank 0 ran the optimizer step: rank 1 skipped " \
        "a step() call" in text, text


def test_a_rank_that_skips_step_at_stage_3_on_four_ranks(dist_pool) -> None:
    """Rank 3 of 4 skips one step() at stage 3: the other three are grouped in one line."""
    text = _diagnosed_on_every_rank(dist_pool(4).run(skip_step, 3, 3, timeout=180))
    assert "ranks 0-2: waits" in text and "all_reduce 'norm'" in text, text
    assert "rank 3: waits" in text and "all_gather 'param'" in text, text
    assert "rank 3 ran a forward of step 1 where rank 0 ran the optimizer step" in text, text


def test_one_optimizer_step_short_then_save_at_stage_3(dist_pool) -> None:
    """Rank 1 stops one step early and saves while rank 0 is in its next forward."""
    text = _diagnosed_on_every_rank(dist_pool(2).run(short_then_save, 1, timeout=120))
    assert "all_gather 'param'" in text and "unit '<root>'" in text and "all_gather_object 'control'" in text, text
    assert "likely cause: rank 1 entered save_checkpoint at step 2 while rank 0 was in its forward of step 2" in text


def test_a_parameter_used_on_one_rank_only_at_stage_3(dist_pool) -> None:
    """Rank 1's forward reads blocks[2]'s weight (32 wide) where rank 0 gathers blocks[1] (24
    wide): different sizes on one transport aborted both processes before."""
    text = _diagnosed_on_every_rank(dist_pool(2).run(parameter_on_one_rank, 1, timeout=120))
    # Different sizes wait on different channels: each rank waits in its own gather.
    assert "rank 0: waits" in text and "(808 x float32; forward, step 0, micro-step 0, unit 'blocks.1')" in text, text
    assert "rank 1: waits" in text and "(1072 x float32; forward, step 0, micro-step 0, unit 'blocks.2')" in text, text
    assert re.search(r"first difference: collective #\d+, where rank 0 and rank 1 wait \(above\)", text), text
    assert "likely cause: at stage 3 rank 0 gathers unit 'blocks.1' where rank 1 gathers unit 'blocks.2': a module " \
        "or parameter used on some ranks only" in text, text


def test_unequal_micro_batch_counts(dist_pool) -> None:
    """gradient_accumulation_steps 2; rank 1 runs three micro-batches in step 1, then both save."""
    text = _diagnosed_on_every_rank(dist_pool(2).run(unequal_micro_batches, 1, timeout=120))
    assert "rank 1: waits" in text and "reduce_scatter 'grad'" in text and "micro-step 6" in text, text
    assert "rank 0 entered save_checkpoint at step 3 while rank 1 was in its backward of step 3: the ranks ran " \
        "different numbers of optimizer steps (or micro-batches)" in text, text


def test_a_rank_stuck_in_its_data_loader(dist_pool) -> None:
    """Rank 2 of 4 sleeps in its data loader (120 s); the others wait in the backward. After
    the hang timeout every rank raises, rank 2 from inside its sleep."""
    outcomes = dist_pool(4).run(data_loader_sleeps, 2, timeout=180)
    text = _diagnosed_on_every_rank(outcomes, LIMIT_S)
    assert "rank 2: is outside zeroshard" in text and "ranks 0, 1, 3: waits" in text, text
    assert "likely cause: rank 2 is alive but outside zeroshard" in text and "data loader" in text, text
    assert "outside zeroshard's collectives" in outcomes[2]["message"], outcomes[2]["message"]


def test_an_expert_rank_with_zero_tokens_is_not_a_hang(dist_pool) -> None:
    """MoE without drops, rank 1 with no token in step 1: every rank still joins the capacity
    agreement and the exchanges, so training goes on and the watchdog stays quiet."""
    for outcome in dist_pool(2).run(moe_zero_tokens, 1, 2, timeout=120):
        assert outcome["type"] is None and outcome["verdict"] is None, outcome
        assert outcome["global_steps"] == 3 and len(outcome["losses"]) == 3, outcome


def _run_hang_example() -> str:
    """Rank-side: examples/hang_diagnosis.py as its __main__ (as torchrun would run it)."""
    from tests.dist.compat.test_examples import run_example_script

    printed = run_example_script("hang_diagnosis.py")
    discard_workers()  # its collectives are still in flight (the example's script just ends)
    return printed


def _masked(text: str) -> str:
    """The text without what changes from run to run: the seconds waited, and the collective
    numbers (they count every collective the process issued, and pooled workers ran others)."""
    return re.sub(r"#\d+", "#N", re.sub(r"waits \d+(\.\d+)? s", "waits N s", text)).strip()


def test_the_documented_diagnosis_is_what_the_example_prints(dist_pool) -> None:
    """docs/reliability.md's transcript is examples/hang_diagnosis.py's output on 2 ranks (rank 0
    prints), but for the seconds and the collective numbers (see `_masked`)."""
    printed = dist_pool(2).run(_run_hang_example, timeout=120)[0]
    page = (REPO_ROOT / "docs" / "reliability.md").read_text(encoding="utf-8")
    documented = re.search(r"<!-- hang-transcript -->\n```text\n(.*?)```", page, re.S).group(1)
    assert _masked(printed) == _masked(documented), printed
