"""`zeroshard demo` end to end: the real CLI, torchrun, 2 CPU processes, the tiny model.

It trains 4 steps, then runs again with --steps 6 and must resume from the step-4 checkpoint
rather than start over.
"""

import json
import math

from zeroshard.demo.cli import main
from zeroshard.demo.train import default_config

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def read_records(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_demo_trains_writes_its_outputs_and_resumes(tmp_path, capfd) -> None:
    # The embedded config with a constant learning rate: the resume check below compares
    # losses, and a 4-step warmup-and-decay schedule would leave too small a margin.
    config = default_config(total_steps=6, on_gpu=False)
    del config["scheduler"]
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
