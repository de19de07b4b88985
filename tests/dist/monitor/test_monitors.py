"""The monitors in a 2-rank run (csv_monitor, tensorboard, wandb offline, all on at once).

Rank 0 writes DeepSpeed's events, indexed by samples: `Train/Samples/train_loss` (the mean of the
step's micro-batch losses rank 0 saw, at the samples before the step), `Train/Samples/lr` and,
with fp16, `Train/Samples/loss_scale` (after the step, at the samples after it); the user's own
`engine.monitor.write_events` scalar too. Rank 1, configured alike, writes nothing. Each file
is read back with its format's own reader (tests/dist/monitor/readers.py) and compared with
what the loop saw. `engine.metrics()` gives the same figures on every rank (its own loss).

Tolerances: lr and the loss scale are exact (floats written by repr; tensorboard stores a
float32, so rel 1e-7 there). The loss: the monitor sums `loss / 2` over the 2 micro-batches in
float32 while the reference is the float64 mean of the same float32 losses: one float32
rounding of a number near 1-10, rel 2e-7, so rel 1e-6.
"""

from __future__ import annotations

import math
import os

import pytest

from tests.dist.monitor.readers import read_csv_dir, read_tensorboard, read_wandb_history
from tests.dist.scenarios.common import Case

pytest.importorskip("tensorboard")
pytest.importorskip("wandb")

TIMEOUT_S = 300
CASES = {"fp32": Case(stage=2, mode="fp32", ga=2, steps=3), "fp16": Case(stage=3, mode="fp16", ga=2, steps=3)}


@pytest.fixture(scope="module", params=sorted(CASES))
def monitored(request, dist_pool, tmp_path_factory):
    from tests.dist.scenarios.monitor_writers import run_monitored

    root = str(tmp_path_factory.mktemp(f"monitors-{request.param}"))
    per_rank = dist_pool(2).run(run_monitored, CASES[request.param], root, timeout=TIMEOUT_S)
    return request.param, root, per_rank


def expected_events(seen: dict, fp16: bool) -> dict[str, list[tuple[int, float]]]:
    """DeepSpeed's events computed from what rank 0's loop saw (float64)."""
    steps = range(len(seen["losses"]))
    events = {
        "Train/Samples/train_loss": [(seen["samples_before"][i], math.fsum(seen["losses"][i]) / len(seen["losses"][i]))
                                     for i in steps],
        "Train/Samples/lr": [(seen["samples_after"][i], seen["lr"][i]) for i in steps],
        "Custom/my_scalar": [(seen["samples_after"][-1], 2.5)],
    }
    if fp16:
        events["Train/Samples/loss_scale"] = [(seen["samples_after"][i], seen["loss_scale"][i]) for i in steps]
    return events


def assert_events(actual: dict[str, list[tuple[int, float]]], expected, loss_rel: float, other_rel: float) -> None:
    assert sorted(actual) == sorted(expected), (sorted(actual), sorted(expected))
    for name, rows in expected.items():
        got = actual[name]
        assert [s for s, _ in got] == [s for s, _ in rows], (name, got, rows)
        rel = loss_rel if name.endswith("train_loss") else other_rel
        for (_, value), (_, want) in zip(got, rows, strict=True):
            assert value == pytest.approx(want, rel=rel, abs=0), (name, got, rows)


def test_the_run_is_what_the_test_thinks(monitored):
    mode, _, per_rank = monitored
    seen = per_rank[0]
    assert seen["samples_before"] == [0, 8, 16] and seen["samples_after"] == [8, 16, 24]  # 2 ranks x 2 x 2
    assert len(set(seen["lr"])) == 3, seen["lr"]  # warmup: a different lr at every step
    assert [r["writes"] for r in per_rank] == [True, False]


def test_csv_monitor(monitored):
    mode, root, per_rank = monitored
    files = read_csv_dir(os.path.join(root, "rank0", "csv", "job"))
    expected = expected_events(per_rank[0], mode == "fp16")
    headers = {name: rows[0] for name, rows in files.items()}
    assert headers == {name.replace("/", "_") + ".csv": ["step", name.split("/")[-1]] for name in expected}
    actual = {next(n for n in expected if n.replace("/", "_") + ".csv" == f): rows for f, (_, rows) in files.items()}
    assert_events(actual, expected, loss_rel=1e-6, other_rel=0)


def test_tensorboard(monitored):
    mode, root, per_rank = monitored
    actual = read_tensorboard(os.path.join(root, "rank0", "tb", "job"))
    assert_events(actual, expected_events(per_rank[0], mode == "fp16"), loss_rel=1e-6, other_rel=1e-7)


def test_wandb_offline(monitored):
    mode, root, per_rank = monitored
    rows = read_wandb_history(os.path.join(root, "rank0", "wandb"))
    actual: dict[str, list[tuple[int, float]]] = {}
    for row in rows:
        for name, value in row.items():
            if not name.startswith("_"):
                actual.setdefault(name, []).append((row["_step"], value))
    assert_events(actual, expected_events(per_rank[0], mode == "fp16"), loss_rel=1e-6, other_rel=0)


def test_rank1_writes_nothing(monitored):
    _, root, _ = monitored
    rank1 = os.path.join(root, "rank1")
    written = [os.path.join(d, f) for d, _, fs in os.walk(rank1) for f in fs]
    assert written == [], written
    assert not os.path.exists(os.path.join(rank1, "csv")) and not os.path.exists(os.path.join(rank1, "tb"))


def test_metrics_on_every_rank(monitored):
    mode, _, per_rank = monitored
    for seen in per_rank:
        for i, figures in enumerate(seen["metrics"]):
            assert figures["step"] == i + 1 and figures["samples"] == seen["samples_after"][i]
            assert figures["lr"] == seen["lr"][i] and figures["loss_scale"] == seen["loss_scale"][i]
            assert figures["loss"] == pytest.approx(math.fsum(seen["losses"][i]) / 2, rel=1e-6, abs=0)
            assert figures["grad_norm"] > 0


def refused_monitor(root: str, section: str) -> str | None:
    """initialize with `section`'s output_path under a regular file: the message this rank got."""
    import pathlib

    import torch
    import torch.distributed as dist

    import zeroshard
    from zeroshard.config.error import ConfigError

    blocker = pathlib.Path(root) / "a_file"
    if dist.get_rank() == 0:
        blocker.write_text("not a folder\n")
    dist.barrier()
    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              section: {"enabled": True, "output_path": str(blocker / "runs"), "job_name": "job"}}
    try:
        zeroshard.initialize(model=torch.nn.Linear(2, 2), config=config)
    except ConfigError as error:
        return str(error)
    return None


@pytest.mark.parametrize("section", ["csv_monitor", "tensorboard"])
def test_a_folder_that_cannot_be_created_is_refused_on_every_rank(dist_pool, tmp_path, section):
    """A monitor folder that cannot be created (output_path under a regular file) refuses the
    config at initialize on both ranks, naming the key and the path (before: rank 0 raised
    NotADirectoryError, rank 1 went on and hung in its first collective)."""
    messages = dist_pool(2).run(refused_monitor, str(tmp_path), section, timeout=60)
    path = str(tmp_path / "a_file" / "runs")
    for rank, message in enumerate(messages):
        assert message is not None, f"rank {rank} was not refused"
        assert message.startswith(f"{section}.output_path={path!r}: cannot create the monitor folder"), message
        assert "NotADirectoryError" in message and f"set {section}.enabled to false" in message, message
    assert messages[0] == messages[1]
