"""The GPU check's host-sync row end to end on the CPU, with its CUDA calls stood in for.

`benchmarks/gpu_check/syncs.py` only runs on a GPU, where each run costs device minutes; a
mistake in its flow would show there first. This test runs it in a subprocess with one gloo
rank: `torch.cuda` inside the check is a stand-in (available, a no-op synchronize, a recorded
debug mode), and `Tensor.tolist` behaves as it does under the debug mode (a warning in "warn",
an error in "error"). The step's one read (`global_norm`'s tolist) must then be counted once per
step and allowed. With one more fake sync from outside the package, the row must fail and name
the whole stack.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

SCRIPT = r"""
import json, os, sys, types, warnings
import torch, torch.distributed as dist
os.environ.update(MASTER_ADDR="127.0.0.1", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
dist.init_process_group("gloo", rank=0, world_size=1, init_method="tcp://127.0.0.1:" + sys.argv[1])
from benchmarks.gpu_check import syncs
mode = {"m": "default"}
fake_cuda = types.SimpleNamespace(is_available=lambda: True, synchronize=lambda: None,
                                  set_sync_debug_mode=lambda m: mode.update(m=m))
syncs.torch = types.SimpleNamespace(cuda=fake_cuda)
real_to, real_tolist = torch.Tensor.to, torch.Tensor.tolist
torch.Tensor.to = lambda self, *a, **k: real_to(self, *("cpu" if x == "cuda" else x for x in a), **k)
def tolist(self):
    if mode["m"] == "warn":
        warnings.warn("called a synchronizing CUDA operation")
    elif mode["m"] == "error":
        raise RuntimeError("called a synchronizing CUDA operation")
    return real_tolist(self)
torch.Tensor.tolist = tolist
clean = syncs.steady_state_syncs(0)
extra = {"n": 0}
real_build = syncs.build_engine
def build_with_a_stray_sync(case):
    engine = real_build(case)
    backward = engine.backward
    def noisy(*args, **kwargs):
        if mode["m"] == "warn" and extra["n"] == 0:
            extra["n"] += 1
            warnings.warn("called a synchronizing CUDA operation")  # raised here: no package frame
        return backward(*args, **kwargs)
    engine.backward = noisy
    return engine
syncs.build_engine = build_with_a_stray_sync
stray = syncs.steady_state_syncs(0)
print("RESULT " + json.dumps({"clean": clean, "stray": stray}, default=str))
dist.destroy_process_group()  # this script's group: freed before interpreter shutdown
"""


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_sync_row_flow_on_cpu():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    result = subprocess.run([sys.executable, "-c", SCRIPT, str(_free_port())], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    line = next(x for x in result.stdout.splitlines() if x.startswith("RESULT "))
    out = json.loads(line[len("RESULT "):])
    status, numbers, detail = out["clean"]
    assert status == "ok", detail
    assert numbers["syncs"] == 2 and numbers["allowed"] == 2 and numbers["not_allowed"] == 0  # 2 steps
    assert numbers["error_mode_first"]["allowed"] == "global_norm"
    assert [p.split(":")[0] for p in numbers["allowed_places"]] == ["step/optimizer_step.py"]
    assert numbers["allow_list"][0].startswith("global_norm (step/optimizer_step.py, <= 1/step): ")
    status, numbers, detail = out["stray"]
    assert status == "FAIL" and numbers["not_allowed"] == 1
    (unattributed,) = numbers["unattributed"]
    assert unattributed["place"] == "(no zeroshard frame)" and unattributed["thread"] == "MainThread"
    assert any("build_with_a_stray_sync" not in f and f.endswith(" noisy") for f in unattributed["stack"])
    assert "(no zeroshard frame) [thread MainThread" in detail
