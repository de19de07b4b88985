"""examples/monitoring.py in one process: the CSV files it says it wrote hold the figures it
printed (the loss the loop's engine.metrics() reported, at DeepSpeed's sample indices)."""

from __future__ import annotations

import re

import pytest

from tests.dist.monitor.readers import read_csv_dir
from tests.unit.compat.test_docs_examples import run_example  # noqa: F401 - the fixture


def test_monitoring_example(run_example, tmp_path):  # noqa: F811 - the fixture
    out = run_example("monitoring.py", "--out", str(tmp_path), "--steps", "4")
    printed = [(int(s), float(loss)) for s, loss in re.findall(r"samples (\d+) loss ([\d.]+)", out)]
    assert [s for s, _ in printed] == [8, 16, 24, 32], out
    files = read_csv_dir(str(tmp_path / "example"))
    assert sorted(files) == ["Train_Samples_lr.csv", "Train_Samples_train_loss.csv", "Train_Samples_weight_norm.csv"]
    losses = files["Train_Samples_train_loss.csv"][1]
    # train_loss sits at the samples before its step; the example prints 4 decimals.
    assert [s for s, _ in losses] == [0, 8, 16, 24]
    assert [v for _, v in losses] == pytest.approx([v for _, v in printed], abs=5e-5)
    assert f"wrote {tmp_path}" in out
