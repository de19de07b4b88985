"""The demo's loss plot and metrics reader."""

import json
import math

import pytest

from zeroshard.demo.plot import moving_average, read_metrics, write_loss_plot

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def test_writes_a_png(tmp_path) -> None:
    records = [{"step": s, "loss": 5.5 - 0.01 * s} for s in range(1, 101)]
    records[49]["val_loss"] = 5.1
    records[99]["val_loss"] = 4.7
    out = write_loss_plot(records, tmp_path / "loss.png")
    data = out.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    assert len(data) > 5_000  # a drawn figure, not an empty file


def test_writes_a_png_with_no_records_and_skips_non_finite_losses(tmp_path) -> None:
    assert write_loss_plot([], tmp_path / "empty.png").read_bytes()[:8] == PNG_SIGNATURE
    records = [{"step": 1, "loss": 5.0}, {"step": 2, "loss": math.nan}, {"step": 3, "loss": 4.0}]
    assert write_loss_plot(records, tmp_path / "nan.png").read_bytes()[:8] == PNG_SIGNATURE


def test_read_metrics_round_trip(tmp_path) -> None:
    path = tmp_path / "metrics.jsonl"
    assert read_metrics(path) == []
    records = [{"step": 1, "loss": 5.5}, {"step": 2, "loss": 5.25, "val_loss": 5.0}]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert read_metrics(path) == records


def test_moving_average() -> None:
    assert moving_average([1.0, 3.0, 5.0, 7.0], half_width=1) == pytest.approx([2.0, 3.0, 5.0, 6.0])
    assert moving_average([2.0, 4.0], half_width=10) == pytest.approx([3.0, 3.0])
    assert moving_average([2.0, 4.0], half_width=0) == pytest.approx([2.0, 4.0])
