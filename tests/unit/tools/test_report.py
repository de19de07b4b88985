"""`zeroshard report RUN_DIR`: PNGs from a run's CSV files (DeepSpeed's csv_monitor layout),
the CSV reader's values, and the refusal of a directory with nothing to plot."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch

import zeroshard
from tests.unit.moe.test_moe_figures import ROWS, TwoMoE
from zeroshard.cli import main
from zeroshard.tools.report import read_run

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
pytest.importorskip("matplotlib")


def write_events(run_dir: Path, events) -> None:
    """DeepSpeed's csv_monitor format: one file per event, header `step,<last name part>`."""
    for name, value, samples in events:
        path = run_dir / (name.replace("/", "_") + ".csv")
        new = not path.exists()
        with path.open("a", newline="") as f:
            writer = csv.writer(f)
            if new:
                writer.writerow(["step", name.split("/")[-1]])
            writer.writerow([samples, value])


def train_and_log(run_dir: Path, steps: int = 12, interval: int = 2) -> list[tuple[str, float, int]]:
    torch.manual_seed(0)
    model = TwoMoE()
    config = {"train_micro_batch_size_per_gpu": ROWS, "steps_per_print": interval, "wall_clock_breakdown": True,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": steps, "warmup_max_lr": 1e-2}}}
    engine, *_ = zeroshard.initialize(model=model, config=config, dist_init_required=False)
    written = []
    for _ in range(steps):
        loss = engine(torch.randn(ROWS, 5), torch.randn(ROWS))
        engine.backward(loss)
        engine.step()
        samples = engine.global_samples
        events = [("Train/Samples/train_loss", float(loss), samples), ("Train/Samples/lr", engine.get_lr()[0], samples)]
        if engine.global_steps % interval == 0:
            events += engine.figures.monitor_events(samples)
        write_events(run_dir, events)
        written += events
    return written


def test_report_writes_the_three_pngs_from_a_csv_run(tmp_path, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    written = train_and_log(run_dir)
    series = read_run(run_dir)
    loss = [(s, v) for n, v, s in written if n == "Train/Samples/train_loss"]
    assert series["Train_Samples_train_loss"] == [(float(s), pytest.approx(v, rel=1e-15)) for s, v in loss]
    assert "Train_MoE_moes.1_expert3_tokens" in series
    out = tmp_path / "plots"
    assert main(["report", str(run_dir), "--out", str(out)]) == 0
    names = sorted(p.name for p in out.iterdir())
    assert names == ["expert_load.png", "loss_lr.png", "step_time.png"]
    for path in out.iterdir():
        data = path.read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 5000, path
    assert capsys.readouterr().out.count("wrote ") == 3


def test_report_refuses_a_directory_without_series(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 1
    assert "no CSV series found" in capsys.readouterr().err
    (tmp_path / "other.csv").write_text("step,x\n1,2\n")
    assert main(["report", str(tmp_path)]) == 1
    assert "none of its 1 series" in capsys.readouterr().err
