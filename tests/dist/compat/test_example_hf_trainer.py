"""docs/hf-trainer.md's example: a Trainer script with `--deepspeed` runs under torchrun on 2 CPU
processes after `zeroshard install-deepspeed-alias`, and its saved model loads."""

import os
import re
import subprocess
import sys
from pathlib import Path

import torch

from zeroshard.tools.deepspeed_alias import install

ROOT = Path(__file__).resolve().parents[3]


def test_hf_trainer_example_runs_under_torchrun(tmp_path):
    from transformers import LlamaForCausalLM

    alias = tmp_path / "alias"
    install(target=alias)  # `zeroshard install-deepspeed-alias --target DIR`; on PYTHONPATH below
    out = tmp_path / "out"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(alias), str(ROOT)]))
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        str(ROOT / "examples" / "hf_trainer.py"),
        "--deepspeed", str(ROOT / "examples" / "configs" / "hf_trainer_zero3.json"),
        "--use_cpu", "--output_dir", str(out), "--max_steps", "6",
    ]
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    steps = re.findall(r"^step (\d+) loss ([0-9.]+)$", result.stdout, flags=re.M)
    assert [int(s) for s, _ in steps] == list(range(1, 7)), result.stdout
    losses = [float(v) for _, v in steps]
    # byte-level text from a random start: near ln(256) = 5.55 at first, then falling
    assert 5.0 < losses[0] < 6.0 and losses[-1] < losses[0] - 0.1, losses
    model = LlamaForCausalLM.from_pretrained(str(out))
    assert all(torch.isfinite(p).all() and p.abs().sum() > 0 for p in model.parameters())
