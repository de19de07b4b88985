"""`zeroshard demo --moe-experts 4 --moe-ep-size 2`: the demo GPT with MoE feed-forward layers
trains end to end (the real CLI, torchrun, 2 CPU processes, the tiny model) and resumes."""

import json
import math

from zeroshard.demo.cli import main
from zeroshard.demo.train import default_config


def test_moe_demo_trains_and_resumes(tmp_path, capfd) -> None:
    config = default_config(total_steps=8, on_gpu=False)
    del config["scheduler"]  # a constant learning rate: the loss drop below is not a schedule's
    config_file = tmp_path / "ds_config.json"
    config_file.write_text(json.dumps(config))
    run_dir = tmp_path / "demo"
    common = ["--model", "tiny", "--nproc", "2", "--run-dir", str(run_dir), "--config", str(config_file)]
    common += ["--sample-tokens", "8", "--eval-every", "4", "--checkpoint-every", "4"]
    common += ["--moe-experts", "4", "--moe-ep-size", "2", "--moe-k", "2"]
    assert main([*common, "--steps", "6"]) == 0
    assert main([*common, "--steps", "8"]) == 0
    assert "resuming from step 6" in capfd.readouterr().out
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 9))
    assert all(math.isfinite(r["loss"]) for r in records)
    # ln 256 = 5.55 at init (plus ~0.02 of load-balancing loss); 8 steps at lr 3e-3 learn the
    # byte frequencies, well beyond one batch's noise.
    assert records[-1]["loss"] < records[0]["loss"] - 0.5, records
