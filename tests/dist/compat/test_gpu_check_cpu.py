"""scripts/gpu_check.sh --device cpu: the GPU check's own code runs end to end on the CPU.

The GPU run happens elsewhere (a leased machine); this keeps the script from rotting between
runs. Every row must be ok, except those that need CUDA (the host-sync checks) and the optional
expert-path benchmark when its script is absent, the fp8 speed row (an fp8 GPU only), and the
AutoTP row (on the CPU the suite runs its grid's cell: tests/dist/autotp), which are skips.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
MAY_SKIP = ("b/sync-debug", "f/moe_experts", "g/fp8 speed", "l/autotp")


def test_gpu_check_runs_on_cpu(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHON=sys.executable, GPU_CHECK_NO_WHEELS="1")
    env["PYTHONPATH"] = str(ROOT)
    result = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), str(tmp_path), "--device", "cpu"],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-3000:]
    rows = json.loads((tmp_path / "gpu_check.json").read_text())["rows"]
    names = [r["name"] for r in rows]
    for prefix in ("a/conformance s3 fp16", "b/sync-debug s0", "c/newton-schulz", "d/offload s3", "e/moe layer",
                   "e/autoep", "f/matmul", "f/model plain", "f/model fsdp2", "f/model zeroshard-s3",
                   "g/fp8 loss s3", "g/fp8 speed", "i/memory s0", "i/memory s3",
                   "j/model plain-compiled", "j/model zeroshard-s3-compiled",
                   "j/model fsdp2-compiled", "k/hang watchdog", "l/autotp tp2 conformance",
                   "m/deterministic s3 bf16"):
        assert any(n.startswith(prefix) for n in names), f"no row {prefix!r} in {names}"
    assert sum(n.startswith("a/conformance") for n in names) == 16
    # The reference on the device against the CPU (here CPU against CPU: the same kernels, zero).
    device_vs_cpu = [r for r in rows if r["name"].startswith("a/reference-vs-cpu ")]
    assert len(device_vs_cpu) == 4 and all(r["numbers"]["loss0_rel"] == 0.0 for r in device_vs_cpu)
    bad = [(r["name"], r["status"], r["detail"][-500:]) for r in rows
           if r["status"] != "ok" and not (r["status"] == "skip" and r["name"].startswith(MAY_SKIP))]
    assert not bad, bad
    # The table is printed last and saved beside the JSON.
    assert result.stdout.rstrip().endswith("FAIL, " + f"{sum(r['status'] == 'skip' for r in rows)} skip")
    assert (tmp_path / "gpu_check.txt").read_text().startswith("check")
    model_rows = [r for r in rows if r["name"].startswith(("f/model", "j/model"))]
    assert all(r["numbers"]["tokens_s"] > 0 for r in model_rows)
    # FLOPs per token come from the model before wrapping: the same for every engine (stage 3
    # partitions the parameters; counting them after wrapping gave it 7x too few on the GPU),
    # and the formula's value for the CPU's preset (tiny, sequence 64).
    from zeroshard.models import build_gpt

    tiny = build_gpt("tiny", block_size=64)
    cfg = tiny.config
    expected = 6 * (tiny.num_params() - tiny.wpe.weight.numel()) + 12 * cfg.n_layer * cfg.n_embd * 64
    assert {r["name"]: r["numbers"]["flops_token"] for r in model_rows} == {r["name"]: expected for r in model_rows}


def test_gpu_check_at_world_2_runs_on_cpu(tmp_path):
    """`--nproc 2` (benchmarks/gpu_check/multi.py under torchrun, gloo): a conformance cell at
    world 2 against the single-process reference, and a model row whose exposed communication
    is its step minus its own rank's simulated compute step. The full matrix at world 2 on the
    CPU is tests/dist/engine/test_conformance.py's; here the script's own code is kept running."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHON=sys.executable, GPU_CHECK_NO_WHEELS="1")
    env["PYTHONPATH"] = str(ROOT)
    only = "a/conformance s3,f/model tiny zeroshard-s3"
    result = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), str(tmp_path), "--device", "cpu",
                             "--nproc", "2", "--only", only], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=240)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-3000:]
    rows = {r["name"]: r for r in json.loads((tmp_path / "gpu_check.json").read_text())["rows"]}
    assert sorted(rows) == ["a/conformance s3 fp32 @2", "f/model tiny zeroshard-s3 @2"], sorted(rows)
    assert all(r["status"] == "ok" for r in rows.values()), rows
    model = rows["f/model tiny zeroshard-s3 @2"]["numbers"]
    assert model["tokens_s_per_gpu"] > 0 and isinstance(model["exposed_comm_s"], float)
    assert (tmp_path / "gpu_check.txt").read_text().startswith("check")
