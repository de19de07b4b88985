"""Ulysses attention tokens/s, zeroshard against DeepSpeed, in one run (used by
benchmarks/sequence_parallel.py's `--deepspeed-python`).

Each (engine, world) is one torchrun launch of benchmarks/sequence_attention_worker.py with
the engine's interpreter: zeroshard under this one, DeepSpeed under `--deepspeed-python` (its
own virtualenv: DeepSpeed is not installed beside zeroshard). Launches alternate between the
engines, `repeat` times, so slow phases of a shared machine fall on both. A length's figure is
the median over every timed iteration of every repeat (an iteration's time is its slowest
rank's); tokens/s = sequence length / that median. Each launch also times the local attention
alone on the gathered shapes, between the engine's iterations; the difference of the medians
("exchange ms") is what the engine's all-to-alls and reshapes cost, less blurred by the noise
between launches on a shared machine. If DeepSpeed cannot start, the reason is recorded in
place of its numbers.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).with_name("sequence_attention_worker.py")


def _reason(stderr: str, returncode: int) -> str:
    """The last exception line of a failed run, or its exit status."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if ("Error" in ln or "Exception" in ln) and not ln.startswith(("File ", "[rank", "torch.distributed")):
            return ln[:300]
    return f"exit status {returncode}: " + (lines[-1][:200] if lines else "no output")


def _env(world: int) -> dict[str, str]:
    threads = str(max(1, (os.cpu_count() or 1) // world))
    return dict(os.environ, OMP_NUM_THREADS=threads, PYTHONPATH=str(ROOT))


def prepare_deepspeed(python: str, timeout_s: float) -> str | None:
    """Build DeepSpeed's CPU shared-memory comm op once, untimed (its first `init_distributed`
    JIT-compiles it: minutes on 2 cores); the reason DeepSpeed cannot start, or None."""
    code = "import deepspeed; from deepspeed.comm.torch import build_shm_op; build_shm_op()"
    try:
        proc = subprocess.run([python, "-c", code], env=_env(1), capture_output=True, text=True, timeout=timeout_s)
    except FileNotFoundError:
        return f"--deepspeed-python {python}: no such interpreter"
    except subprocess.TimeoutExpired:
        return f"DeepSpeed's CPU comm op did not build within {timeout_s:.0f} s"
    if proc.returncode != 0:
        return "DeepSpeed does not start here: " + _reason(proc.stderr, proc.returncode)
    return None


def run_worker(python: str, engine: str, world: int, lengths: list[int], iters: int, warmup: int,
               timeout_s: float) -> dict[str, Any]:
    cmd = [python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world), str(WORKER),
           "--engine", engine, "--iters", str(iters), "--warmup", str(warmup), "--lengths", *map(str, lengths)]
    try:
        proc = subprocess.run(cmd, env=_env(world), capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"did not finish within {timeout_s:.0f} s"}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    return {"error": _reason(proc.stderr, proc.returncode)}


def compare(worlds: list[int], lengths: list[int], iters: int, warmup: int, repeat: int,
            deepspeed_python: str | None, python: str, timeout_s: float = 600) -> dict[str, Any]:
    engines = {"zeroshard": python}
    problem = None
    if deepspeed_python:
        problem = prepare_deepspeed(deepspeed_python, max(timeout_s, 900))
        engines["deepspeed"] = deepspeed_python
    times: dict[tuple[str, int, int], list[float]] = {}
    errors: dict[tuple[str, int], str] = {}
    versions: dict[str, str] = {}
    sums: dict[tuple[str, int, int], float] = {}
    local: dict[tuple[str, int, int], list[float]] = {}
    for _ in range(repeat):
        for world in worlds:
            for engine, interpreter in engines.items():
                if engine == "deepspeed" and problem:
                    errors[(engine, world)] = problem
                    continue
                if (engine, world) in errors:
                    continue
                out = run_worker(interpreter, engine, world, lengths, iters, warmup, timeout_s)
                if "error" in out:
                    errors[(engine, world)] = out["error"]
                    continue
                versions[engine] = f"{out['version']} (torch {out['torch']})"
                for row in out["lengths"]:
                    times.setdefault((engine, world, row["length"]), []).extend(row["times_s"])
                    local.setdefault((engine, world, row["length"]), []).extend(row["local_attention_times_s"])
                    sums[(engine, world, row["length"])] = row["output_abs_sum"]
    rows = []
    for world in worlds:
        for length in lengths:
            row: dict[str, Any] = {"world": world, "length": length}
            for engine in engines:
                samples = times.get((engine, world, length))
                if samples:
                    median = statistics.median(samples)
                    local_median = statistics.median(local[(engine, world, length)])
                    row[engine] = {"median_ms": round(median * 1e3, 2), "tokens_per_s": round(length / median),
                                   "samples": len(samples), "local_attention_ms": round(local_median * 1e3, 2),
                                   "exchange_ms": round((median - local_median) * 1e3, 2)}
                else:
                    row[engine] = {"error": errors.get((engine, world), "no result")}
            zs, ds = row["zeroshard"].get("tokens_per_s"), row.get("deepspeed", {}).get("tokens_per_s")
            if zs and ds:
                row["ratio_zeroshard_over_deepspeed"] = round(zs / ds, 2)
                row["exchange_ms_zeroshard_minus_deepspeed"] = round(
                    row["zeroshard"]["exchange_ms"] - row["deepspeed"]["exchange_ms"], 2)
                a, b = sums[("zeroshard", world, length)], sums[("deepspeed", world, length)]
                row["outputs_agree"] = abs(a - b) <= 1e-4 * abs(b)  # fp32 sums in another order
            rows.append(row)
    return {"rows": rows, "versions": versions, "iters": iters, "warmup": warmup, "repeat": repeat,
            "shapes": "batch 1, 4 heads x 32, [batch, seq, heads, dim], causal SDPA"}


def print_table(result: dict[str, Any]) -> None:
    print(f"\nUlysses DistributedAttention forward+backward, {result['shapes']}; gloo; median of "
          f"{result['iters']} iterations x {result['repeat']} launches; versions {result['versions']}")
    print("(exchange ms = the engine's median minus its local attention's median in the same launch)")
    print("world  length   zeroshard ms  tok/s   exchange ms  deepspeed ms  tok/s   exchange ms  "
          "zeroshard/deepspeed  outputs agree")
    for row in result["rows"]:
        cells = []
        for engine in ("zeroshard", "deepspeed"):
            cell = row.get(engine)
            if cell is None:
                cells.append(f"{'-':<13} {'-':<7} {'-':<12}")
            elif "error" in cell:
                cells.append(f"not run: {cell['error']}")
            else:
                cells.append(f"{cell['median_ms']:<13} {cell['tokens_per_s']:<7} {cell['exchange_ms']:<12}")
        ratio = row.get("ratio_zeroshard_over_deepspeed", "-")
        agree = row.get("outputs_agree", "-")
        print(f"{row['world']:<6} {row['length']:<8} {cells[0]} {cells[1]} {ratio!s:<20} {agree}")
