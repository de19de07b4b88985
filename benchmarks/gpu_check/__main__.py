"""Entry point: python -m benchmarks.gpu_check OUTDIR [--device cuda|cpu] [--quick]
(from the repository root, with it on PYTHONPATH; scripts/gpu_check.sh does both)."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

from benchmarks.gpu_check.report import Report, Skip
from benchmarks.process_group import close_group
from benchmarks.process_group import init_group_of_one as init_group

REPO = Path(__file__).resolve().parents[2]


def experts_row(device: torch.device, quick: bool) -> dict:
    """The expert-path benchmark (benchmarks/moe_experts.py, built on another branch) when it
    exists; its exit status and output's tail."""
    script = REPO / "benchmarks" / "moe_experts.py"
    if not script.exists():
        raise Skip("benchmarks/moe_experts.py is not in this checkout")
    # Its own clock (--seconds) covers its setup and every path's repeats; the subprocess gets
    # 30 s more for the interpreter and torch's import, which that clock does not see.
    seconds = 15 if device.type == "cpu" else (40 if quick else 75)
    cmd = [sys.executable, str(script), "--device", device.type, "--seconds", str(seconds)]
    result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=seconds + 30)
    tail = (result.stdout + result.stderr)[-1500:]
    if result.returncode != 0:
        return "FAIL", {"rc": result.returncode, "cmd": " ".join(cmd[1:])}, tail
    return "ok", {"rc": 0, "cmd": " ".join(cmd[1:]), "tail": tail.strip().splitlines()[-8:]}, ""


def muon_row(device: torch.device, outdir: Path) -> dict:
    """benchmarks/muon_step.py: the Muon step against AdamW's, Newton-Schulz's FLOP/s against
    the bf16/fp16 matmul rate; its table's tail, and its JSON beside the report."""
    seconds = 210 if device.type == "cuda" else 150
    cmd = [sys.executable, str(REPO / "benchmarks" / "muon_step.py"), "--device", device.type, "--steps", "5",
           "--json", str(outdir / "muon_step.json")]
    if device.type == "cuda":  # Newton-Schulz compiled too (issue 40: 1.3x on the Moonlight-like shapes)
        cmd += ["--compile", "inductor"]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
    result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=seconds, env=env)
    tail = (result.stdout + result.stderr)[-1500:]
    if result.returncode != 0:
        return "FAIL", {"rc": result.returncode, "cmd": " ".join(cmd[1:])}, tail
    return "ok", {"rc": 0, "cmd": " ".join(cmd[1:]), "tail": result.stdout.strip().splitlines()[-9:]}, ""


def hang_row(device: torch.device) -> dict:
    """benchmarks/gpu_check/hang.py in a process of its own (it aborts its NCCL group): the hang
    watchdog at world 1 plus a simulated peer, the diagnosis raised on the main thread and, on
    CUDA, the communicators aborted only after it was stored."""
    cmd = [sys.executable, "-m", "benchmarks.gpu_check.hang", "--device", device.type]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT", "LOCAL_RANK")}
    result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120, env=env)
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    if result.returncode != 0 or not lines:
        return "FAIL", {"rc": result.returncode}, (result.stdout + result.stderr)[-1500:]
    numbers = json.loads(lines[-1])
    diagnosis = numbers.pop("diagnosis")
    return "ok", numbers, diagnosis


def autotp_row(device: torch.device, outdir: Path) -> dict:
    """benchmarks/autotp_conformance.py --quick: tensor parallelism against the unsplit model (fp32
    within 1e-5), the exchanges per micro-step and the parameters per rank. Its processes talk over
    gloo on the CPU whatever the device: a tensor group needs one device per rank, and this check has
    one (a GPU measurement needs 2+ GPUs or a simulated group): not measured on a GPU. Skipped on
    the CPU: there it is the suite's own run (tests/dist/autotp/test_autotp.py runs a cell of this
    grid through the same code), and a second start of its processes cost the suite ~10 s."""
    if device.type != "cuda":
        raise Skip("on the CPU the suite runs this grid's cell (tests/dist/autotp/test_autotp.py)")
    cmd = [sys.executable, str(REPO / "benchmarks" / "autotp_conformance.py"), "--world", "2", "--tp", "2",
           "--steps", "2", "--no-baseline", "--quick", "--json", str(outdir / "autotp_conformance.json")]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT", "LOCAL_RANK")}
    result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=170, env=env)
    tail = (result.stdout + result.stderr)[-1500:]
    if result.returncode != 0:
        return "FAIL", {"rc": result.returncode, "cmd": " ".join(cmd[1:])}, tail
    return "ok", {"rc": 0, "cmd": " ".join(cmd[1:]), "tail": result.stdout.strip().splitlines()[-4:]}, ""


def simulated_rows(row, device: torch.device) -> None:
    """Check h: zeroshard simulate's scaling grid (benchmarks/simulate_scale.py; on the CPU its first
    row), zeroshard beside FSDP2, and the world-1 row against a real world-1 run (within 10%)."""
    from benchmarks import simulate_scale

    grid = simulate_scale.GRIDS["gpu" if device.type == "cuda" else "cpu"]
    if device.type != "cuda":
        grid = grid[:1]
    for model, overrides, world, stage, seq in grid:
        for engine in ("zeroshard", "fsdp2"):
            def check(m=model, o=overrides, w=world, s=stage, q=seq, e=engine):
                report = simulate_scale.run_row(m, o, w, s, q, e, device.type, steps=3)
                if "error" in report:
                    return "FAIL", {}, report["error"]
                fabrics = {f["name"]: f for f in report["fabrics"]}
                return {"simulated": True, "states_gib": report["model_states_bytes"]["total"] / 2**30,
                        "peak_alloc_gib": report["peak_device_allocated_bytes"] / 2**30,
                        "compute_step_s": report["compute_step_s"],
                        **{f"exposed_{n}_s": fabrics[n]["exposed_comm_s"] for n in fabrics},
                        **{f"modelled_{n}_s": fabrics[n]["modelled_comm_s"] for n in fabrics}}

            row(f"h/simulated {model} W={world} s{stage} {engine}", check, 300)
    model, overrides, _, stage, seq = grid[0]

    def world_one():
        numbers = simulate_scale.world_one(model, overrides, stage, seq, device.type, steps=3)
        if device.type == "cuda" and abs(numbers["ratio"] - 1) > 0.10:
            return "FAIL", numbers, f"simulated world-1 compute step {numbers['ratio']:.3f}x the real world-1 step"
        return numbers

    row(f"h/simulated {model} world-1 vs real", world_one, 300)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpu_check", description=__doc__)
    parser.add_argument("outdir", type=Path)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="the exploratory run: a 30 s model benchmark")
    parser.add_argument("--only", default="", help="comma-separated row-name prefixes to run (debugging)")
    parser.add_argument("--simulated", action="store_true",
                        help="add the simulated scaling rows (h/, zeroshard simulate; ~10 min on an H200)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: --device cuda but no CUDA device is available", file=sys.stderr)
        return 2
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    on_gpu = device.type == "cuda"
    meta = {
        "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(0) if on_gpu else platform.processor() or "cpu",
        "torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
        "quick": args.quick, "argv": sys.argv,
    }
    report = Report(args.outdir, meta)
    only = [p for p in args.only.split(",") if p]
    started = time.perf_counter()

    def row(name, check, budget):
        if only and not any(name.startswith(p) for p in only):
            return None
        return report.run(name, check, budget)

    if args.simulated:  # before the group of one: a simulated world needs the default group to itself
        simulated_rows(row, device)
    init_group(device)

    from benchmarks.gpu_check import conformance, model_bench, numerics, syncs

    for stage in conformance.STAGES:
        for mode in conformance.MODES:
            row(f"a/conformance s{stage} {mode}", lambda s=stage, m=mode: conformance.conformance(s, m), 60)
    # The engine compiled with inductor (docs/compile.md), within the same tolerances; GPU only (the
    # suite checks aot_eager against eager, benchmarks/compile_conformance.py inductor on the CPU).
    for stage in conformance.STAGES if on_gpu else ():
        row(f"a/conformance-compiled s{stage} bf16",
            lambda s=stage: conformance.conformance(s, "bf16", model_bench.compile_backend(device)), 120)
    for mode in conformance.MODES:  # informational: the two devices' kernels, no engine
        row(f"a/reference-vs-cpu {mode}", lambda m=mode: conformance.reference_device_vs_cpu(m, device), 60)
    if on_gpu:
        syncs.print_allow_list()
    for stage in conformance.STAGES:
        row(f"b/sync-debug s{stage} bf16", lambda s=stage: syncs.steady_state_syncs(s), 60)
    row("c/newton-schulz fp16 gram", lambda: numerics.newton_schulz(device, big=on_gpu), 60)
    for stage in (2, 3):
        row(f"d/offload s{stage} pinned", lambda s=stage: numerics.offload(s), 90)
    row("e/moe layer vs cpu", lambda: numerics.moe_layer(device), 60)
    row("e/autoep mixtral vs cpu", lambda: numerics.autoep_layer(device), 90)
    row("f/moe_experts (optional)", lambda: experts_row(device, args.quick), 200 if not args.quick else 130)
    row("f/muon_step", lambda: muon_row(device, args.outdir), 220 if on_gpu else 160)
    row("l/autotp tp2 conformance (gloo)", lambda: autotp_row(device, args.outdir), 180)

    from benchmarks.gpu_check import fp8

    for stage in conformance.STAGES if on_gpu else (3,):
        row(f"g/fp8 loss s{stage}", lambda s=stage: fp8.fp8_loss(s, device), 120)
    row("g/fp8 speed 8b-shaped", lambda: fp8.fp8_speed(device), 240)
    row(f"k/hang watchdog {'nccl' if on_gpu else 'gloo'} + simulated peer", lambda: hang_row(device), 120)

    from benchmarks.gpu_check import deterministic

    # The CPU run keeps the check's code alive (tests/dist/grads/test_deterministic_reduction.py
    # proves the mode on the CPU): one cell.
    for stage in conformance.STAGES if on_gpu else (3,):
        for mode in ("fp32", "bf16") if on_gpu else ("bf16",):
            row(f"m/deterministic s{stage} {mode}",
                lambda s=stage, m=mode: deterministic.tree_on_device(s, m, device), 60)

    size = model_bench.BenchSize.for_device(device, args.quick)
    box: dict = {}

    def matmul():
        box["matmul"] = model_bench.matmul_tflops(device)["tflops"]
        return {"tflops": box["matmul"], "model": size.preset, "seq": size.seq, "micro": size.micro}

    row("f/matmul bf16", matmul, 60)
    # The whole model benchmark: ~3.5 min on an H100; the quick run's 30 s.
    bench_budget = 30 if args.quick else 210
    bench_start = time.perf_counter()
    for engine in model_bench.ENGINES:
        left = bench_budget - (time.perf_counter() - bench_start)
        if left <= 0:
            row(f"f/model {engine}", lambda: (_ for _ in ()).throw(Skip("model benchmark's time used up")), 5)
            continue
        row(f"f/model {engine}",
            lambda e=engine: model_bench.bench_engine(e, size, device, box.get("matmul")),
            max(left, 20 if args.quick else 60))
    # The same model compiled block by block (issue 40): zeroshard's engine.compile() at stages 0-3,
    # the plain loop and FSDP2 as torchtitan compiles them; compile time is in first_step_s.
    compiled_budget = 60 if args.quick else 360
    compiled_start = time.perf_counter()
    for engine in model_bench.COMPILED if on_gpu else model_bench.COMPILED_ON_CPU:
        left = compiled_budget - (time.perf_counter() - compiled_start)
        if left <= 0:
            row(f"j/model {engine}", lambda: (_ for _ in ()).throw(Skip("compiled benchmark's time used up")), 5)
            continue
        row(f"j/model {engine}",
            lambda e=engine: model_bench.bench_engine(e, size, device, box.get("matmul")),
            max(left, 30 if args.quick else 120))

    from benchmarks.gpu_check import memory

    # Issue 39: the predicted peak against the measured one; on the CPU (CI) stages 0 and 3 only.
    for stage in conformance.STAGES if on_gpu else (0, 3):
        row(f"i/memory s{stage}", lambda s=stage: memory.memory_peak(s, device), 240 if on_gpu else 90)
    report.meta["seconds"] = round(time.perf_counter() - started, 1)
    report._write()
    table = report.table()
    (args.outdir / "gpu_check.txt").write_text(table + "\n")
    print(table, flush=True)
    close_group()  # every row's engines and FSDP2 models are gone first (benchmarks/process_group.py)
    return 0 if all(r.status != "FAIL" for r in report.rows) else 1


if __name__ == "__main__":
    sys.exit(main())
