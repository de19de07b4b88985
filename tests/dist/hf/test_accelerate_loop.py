"""A plain Accelerate loop trains on zeroshard through the `deepspeed` alias, 2 CPU processes.

- `accelerate launch --config_file cfg.yaml` with `distributed_type: DEEPSPEED` and a
  `deepspeed_config_file` (ZeRO-3, "auto" values as Accelerate users write them): the launcher's
  own path (its DeepSpeed launcher over torchrun, the plugin built from its environment).
- `Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=...))` in a pool worker: stages
  0 and 3, and stage 2 with 2 accumulation steps under `accelerator.accumulate`.

Each run's per-micro-batch losses equal the same loop without DeepSpeed in one process
(tests/dist/scenarios/accelerate_loop.py; its note explains why accelerate sees one process on
a CPU-only machine and every rank reads the same batches). Tolerance: fp32; both ranks hold
the same batch, so the reduced gradient is the mean of two equal gradients (exact), but the
engine's flat buffers and buckets may sum in another order than the reference: 1e-6 (a few
float32 spacings at losses near 4.9) allows that, far below any step's loss change (~1e-2).
Measured: equal.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

from tests.dist.harness import REPO_ROOT

TIMEOUT_S = 600
RTOL, ATOL = 1e-6, 1e-6
BASE = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0}
# Stage 3 with stage3_param_persistence_threshold 0: the default (1e5 elements) would keep every
# unit of the tiny model whole, and nothing would be gathered or freed.
CASES = [{**BASE, "zero_optimization": {"stage": s, **({"stage3_param_persistence_threshold": 0} if s == 3 else {})}}
         for s in (0, 3)] + [
    {**BASE, "gradient_accumulation_steps": 2, "zero_optimization": {"stage": 2}},
]
LAUNCH_DS_CONFIG = {
    "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
    "bf16": {"enabled": "auto"},
    "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                          "stage3_param_persistence_threshold": "auto"},
}
LAUNCH_YAML = """compute_environment: LOCAL_MACHINE
distributed_type: DEEPSPEED
deepspeed_config:
  deepspeed_config_file: {config}
  zero3_init_flag: false
num_machines: 1
num_processes: 2
machine_rank: 0
main_process_port: {port}
"""


def _check(result: dict, label: str) -> None:
    assert result["engine"], f"{label}: accelerate did not hand back a DeepSpeedEngine"
    assert result["num_processes"] == 1, "accelerate's CPU count changed: revisit the note in accelerate_loop.py"
    torch.testing.assert_close(torch.tensor(result["losses"], dtype=torch.float64),
                               torch.tensor(result["reference"], dtype=torch.float64), rtol=RTOL, atol=ATOL,
                               msg=lambda m: f"{label}: {m}")


def test_deepspeed_plugin_loop_equals_the_loop_without_deepspeed(hf_pool) -> None:
    pool, alias = hf_pool
    runs = pool.run("tests.dist.scenarios.accelerate_loop:plugin_cases", alias, CASES, timeout=TIMEOUT_S)
    for rank, results in enumerate(runs):
        for config, result in zip(CASES, results, strict=True):
            label = f"rank {rank}, stage {config['zero_optimization']['stage']}, " \
                    f"ga {config.get('gradient_accumulation_steps', 1)}"
            assert result["stage"] == config["zero_optimization"]["stage"], label
            _check(result, label)
            assert result["global_steps"] == 4, label


def test_accelerate_launch_with_a_deepspeed_config_file(hf_pool, tmp_path) -> None:
    from tests.dist.harness import _free_port

    _, alias = hf_pool
    ds_config = tmp_path / "ds_config.json"
    ds_config.write_text(json.dumps(LAUNCH_DS_CONFIG))
    yaml = tmp_path / "accelerate.yaml"
    yaml.write_text(LAUNCH_YAML.format(config=ds_config, port=_free_port()))
    out = tmp_path / "result.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([alias, str(REPO_ROOT)]), OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(yaml),
         str(REPO_ROOT / "tests/dist/scenarios/accelerate_loop.py"), str(out)],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    result = json.loads(out.read_text())
    assert result["distributed_type"] == "DistributedType.DEEPSPEED" and result["world_size"] == 2, result
    assert result["stage"] == 3
    _check(result, "accelerate launch, stage 3")
