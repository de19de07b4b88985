"""benchmarks/moe_experts.py keeps its command line (the GPU check calls it): a tiny CPU run
writes a row per path, each timed at least once. (Whether it keeps within --seconds is a
matter of wall time on a loaded machine, so not asserted here; the GPU check bounds the call
with a subprocess timeout.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[3]


def test_cpu_run_writes_every_path_within_its_seconds(tmp_path) -> None:
    out = tmp_path / "rows.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "moe_experts.py"), "--device", "cpu", "--seconds", "20",
           "--tokens", "64", "--hidden", "32", "--ffn", "24", "--experts", "8", "--top-k", "2", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    rows = {r["path"]: r for r in result["rows"]}
    assert {"auto", "loop", "bmm"} <= rows.keys()
    for name, row in rows.items():
        assert row["repeats"] >= 1 and row["tokens_per_s"] > 0, name
    assert rows["loop"]["took"] == ["loop"] and rows["bmm"]["took"] == ["bmm"]
    assert "tokens/s" in proc.stdout
