"""`zeroshard demo` end to end: the real CLI, torchrun, 2 CPU processes, the tiny model.

It trains 4 steps, then runs again with --steps 6 and must resume from the step-4 checkpoint
rather than start over. Both runs write csv_monitor files into the run dir and the
`zeroshard report` PNGs beside loss.png.
"""

import csv
import json
import math
import struct

from zeroshard.demo.cli import main
from zeroshard.demo.train import default_config

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def read_records(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def read_csv_series(path) -> tuple[int, list[tuple[float, float]]]:
    """(header rows, [(samples, value)]) of a csv_monitor file; a resumed run adds a header."""
    with path.open(newline="") as f:
        rows = [row for row in csv.reader(f) if row]
    headers = [row for row in rows if row[0] == "step"]
    return len(headers), [(float(a), float(b)) for a, b in rows if a != "step"]


def check_png(path, width: int, height: int) -> None:
    """A real PNG of the figure's size: the signature, then the IHDR chunk's width and height."""
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, path
    assert data[12:16] == b"IHDR", path
    assert struct.unpack(">II", data[16:24]) == (width, height), path
    # A 700x400 plot with axes, ticks and a curve compresses to tens of kB; a blank canvas of
    # that size is about 2 kB, so 10 kB says something was drawn.
    assert len(data) > 10_000, (path, len(data))


def test_demo_trains_writes_its_outputs_and_resumes(tmp_path, capfd) -> None:
    # The embedded config with a constant learning rate: the resume check below compares
    # losses, and a 4-step warmup-and-decay schedule would leave too small a margin.
    config = default_config(total_steps=6, on_gpu=False)
    del config["scheduler"]
    # Timers close every steps_per_print steps: 2 gives step_time.png bars within 4 steps.
    config["steps_per_print"] = 2
    config_file = tmp_path / "ds_config.json"
    config_file.write_text(json.dumps(config))
    run_dir = tmp_path / "demo"
    common = ["--model", "tiny", "--nproc", "2", "--run-dir", str(run_dir), "--config", str(config_file)]
    common += ["--sample-tokens", "16", "--eval-every", "2", "--checkpoint-every", "2"]

    assert main([*common, "--steps", "4"]) == 0
    first_out = capfd.readouterr().out
    records = read_records(run_dir)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for r in records:
        assert math.isfinite(r["loss"]) and r["tokens_per_s"] > 0 and r["grad_norm"] > 0, r
    # The first step sees randomly initialised weights: close to uniform over 256 bytes
    # (ln 256 = 5.545; 0.3 covers one batch's noise and the init's small logits).
    assert abs(records[0]["loss"] - math.log(256)) < 0.3
    assert "val_loss" in records[1] and "val_loss" in records[3]
    assert (run_dir / "loss.png").read_bytes()[:8] == PNG_SIGNATURE
    plan = (run_dir / "precision_plan.txt").read_text()
    assert "Precision plan" in plan and "fp32" in plan, plan
    assert (run_dir / "checkpoints" / "latest").exists()
    assert "sample:" in first_out
    # The report PNGs (7x4 inches at 100 dpi, tools/report.py) beside loss.png; no MoE layers,
    # so no expert_load.png. The output says where they are and what they were drawn from.
    check_png(run_dir / "loss_lr.png", 700, 400)
    check_png(run_dir / "step_time.png", 700, 400)
    assert not (run_dir / "expert_load.png").exists()
    assert "loss_lr.png, step_time.png" in first_out
    assert f"csv_monitor files in {run_dir / 'csv'}" in first_out

    assert main([*common, "--steps", "6"]) == 0
    second_out = capfd.readouterr().out
    assert "resuming from step 4" in second_out
    records = read_records(run_dir)
    # The step count continues where the first run stopped; nothing restarts at step 1.
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert records[5]["elapsed_s"] > records[3]["elapsed_s"]
    # The weights were restored, not re-initialised: after 4 steps at lr 3e-3 the loss is
    # already well below its starting value, and step 5 continues from there. (A fresh model
    # would start near ln 256 again; the margin is several times the batch-to-batch noise.)
    assert records[4]["loss"] < records[0]["loss"] - 0.3, records

    # The csv_monitor files of both runs (the second appended, with its own header row) hold
    # what metrics.jsonl holds, at DeepSpeed's sample indices: the loss at the samples seen
    # before its step, the lr after it. Exact: both are the same Python floats, and csv
    # writes a float's repr, which reads back bit for bit.
    check_png(run_dir / "loss_lr.png", 700, 400)
    samples_per_step = config["train_micro_batch_size_per_gpu"] * config["gradient_accumulation_steps"] * 2
    csv_dir = run_dir / "csv"
    headers, logged = read_csv_series(csv_dir / "Train_Samples_train_loss_mean_over_ranks.csv")
    assert headers == 2
    assert logged == [((r["step"] - 1) * samples_per_step, r["loss"]) for r in records]
    _, lrs = read_csv_series(csv_dir / "Train_Samples_lr.csv")
    assert lrs == [(r["step"] * samples_per_step, r["lr"]) for r in records]
    # The engine's own train_loss is rank 0's loss alone; metrics.jsonl has the mean over the
    # 2 ranks, so they differ by half the ranks' difference: different batches of one model,
    # under 0.15 nats here (the batch-to-batch spread of a 16-window batch is a few hundredths).
    _, rank0 = read_csv_series(csv_dir / "Train_Samples_train_loss.csv")
    assert [x for x, _ in rank0] == [x for x, _ in logged]
    for (_, mine), r in zip(rank0, records, strict=True):
        assert abs(mine - r["loss"]) < 0.15, (mine, r)
    # wall_clock_breakdown: one interval closed every 2 steps, at steps 2, 4 and 6.
    _, step_ms = read_csv_series(csv_dir / "Train_Samples_elapsed_time_ms_step.csv")
    assert [x for x, _ in step_ms] == [s * samples_per_step for s in (2, 4, 6)]
    assert all(ms > 0 for _, ms in step_ms), step_ms
