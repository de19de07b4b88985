"""zeroshard side by side with torch DDP, FSDP2 and DeepSpeed on one GPT workload.

One command runs everything, one engine after the other, and prints the table:

    python benchmarks/peers.py --world-size 2 --model small --steps 30

Each cell (an engine at a stage or setting, in one precision mode) is one subprocess:

    python -m torch.distributed.run --standalone --nproc_per_node W benchmarks/peers.py \\
        --engine zeroshard --stage 2 --mode bf16 --model small --steps 30

(the compute floor runs as one plain process). Every run uses OMP_NUM_THREADS = cores // W,
the same seed, data, AdamW, clipping at 1.0 and global batch. The results land in
benchmarks/results/NAME.json with a chart NAME.png; see docs/benchmarks.md for what each
number means.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # the peers_* modules beside this file
sys.path.insert(1, str(HERE.parent))  # zeroshard from the checkout when not installed

MODES_DEFAULT = "fp32,bf16,autocast,fp16"
ENGINES_DEFAULT = "floor,floor-par,zeroshard,ddp,fsdp2,deepspeed"


def _bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes"):
        return True
    if text.lower() in ("0", "false", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world-size", type=int, default=2, help="ranks per distributed run (default 2)")
    p.add_argument("--model", default="small", help="demo model preset: tiny, small, medium, ...")
    p.add_argument("--steps", type=int, default=30, help="timed optimizer steps (default 30)")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first (default 5)")
    p.add_argument("--global-batch", type=int, default=16, help="sequences per step over all ranks")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cpu: gloo, CPU batches (default); cuda: NCCL, one GPU per rank (see peers_device.py)")
    p.add_argument("--optimizer", choices=("adamw", "muon"), default="adamw",
                   help="AdamW for every engine (default), or Muon for zeroshard (peers then not run)")
    # Orchestrator only.
    p.add_argument("--modes", default=MODES_DEFAULT, help=f"comma list (default {MODES_DEFAULT})")
    p.add_argument("--engines", default=ENGINES_DEFAULT, help=f"comma list (default {ENGINES_DEFAULT})")
    p.add_argument("--stages", default="0,1,2,3", help="ZeRO stages for zeroshard and DeepSpeed")
    p.add_argument("--repeat", type=int, default=1, help="run every cell N times, round-robin; report medians")
    p.add_argument("--name", default=None, help="results name (default: a timestamp)")
    p.add_argument("--results-dir", default=str(HERE / "results"))
    p.add_argument("--timeout", type=int, default=900, help="seconds allowed per run")
    p.add_argument("--profile", default="", help="comma list of cell labels to profile, e.g. 'zeroshard s3,ddp'")
    p.add_argument("--report-only", action="store_true",
                   help="rebuild the table, Markdown and chart of --name from its saved runs")
    p.add_argument("--merge", default="",
                   help="comma list of earlier results names whose runs count as repeats of this one; "
                        "NAME:fp32+bf16 takes only those modes (cells this sweep lacks are added)")
    # Worker (one run; set by the orchestrator).
    p.add_argument("--engine", default=None, help="run one engine (worker mode, under torchrun)")
    p.add_argument("--mode", default="fp32")
    p.add_argument("--stage", type=int, default=None)
    p.add_argument("--reshard", type=_bool, default=None)
    p.add_argument("--result-file", default=None)
    p.add_argument("--profile-out", default=None)
    args = p.parse_args(argv)
    if args.world_size < 1 or args.steps < 1 or args.warmup < 0:
        p.error("--world-size and --steps must be >= 1 and --warmup >= 0")
    if args.device != "cpu" and not args.report_only:
        from peers_device import check_device

        problem = check_device(args.device, args.world_size)
        if problem:
            p.error(problem)
    return args


# ------------------------------------------------------------------------------------------
# Orchestrator
# ------------------------------------------------------------------------------------------


def plan_cells(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every (engine, setting, mode) to run, in order, with the reason when one cannot run."""
    from peers_engines import ENGINES, unsupported
    from peers_report import label
    from peers_workload import MODES

    modes = [m for m in args.modes.split(",") if m]
    engines = [e for e in args.engines.split(",") if e]
    for m in modes:
        if m not in MODES:
            raise SystemExit(f"--modes: unknown mode {m!r}; use {', '.join(MODES)}.")
    for e in engines:
        if e not in ENGINES:
            raise SystemExit(f"--engines: unknown engine {e!r}; use {', '.join(ENGINES)}.")
    stages = [int(s) for s in args.stages.split(",") if s]
    deepspeed_missing = None
    if "deepspeed" in engines and importlib.util.find_spec("deepspeed") is None:
        deepspeed_missing = "deepspeed is not installed (pip install deepspeed==0.19.8 with DS_BUILD_OPS=0)"
    cells = []
    for mode in modes:
        for engine in engines:
            settings: list[tuple[int | None, bool | None]] = [(None, None)]
            if engine in ("zeroshard", "deepspeed"):
                settings = [(s, None) for s in stages]
            elif engine == "fsdp2":
                settings = [(None, True), (None, False)]
            for stage, reshard in settings:
                reason = unsupported(engine, mode) or (deepspeed_missing if engine == "deepspeed" else None)
                if not reason and args.optimizer == "muon" and engine != "zeroshard":
                    reason = "Muon is zeroshard's optimizer here; this peer runs AdamW only"
                cells.append({
                    "label": label(engine, stage, reshard), "engine": engine, "mode": mode,
                    "stage": stage, "reshard": reshard, "status": "not run" if reason else "pending",
                    "reason": reason or "", "results": [], "logs": [],
                })
    return cells


def _command(args: argparse.Namespace, cell: dict[str, Any], result_file: Path, profile_dir: Path | None) -> list[str]:
    script = str(HERE / "peers.py")
    if cell["engine"] == "floor":
        launch = [sys.executable, script]
    else:
        launch = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                  f"--nproc_per_node={args.world_size}", script]
    cmd = launch + [
        "--engine", cell["engine"], "--mode", cell["mode"], "--model", args.model,
        "--world-size", str(args.world_size), "--steps", str(args.steps), "--warmup", str(args.warmup),
        "--global-batch", str(args.global_batch), "--seed", str(args.seed), "--optimizer", args.optimizer,
        "--device", args.device, "--result-file", str(result_file),
    ]
    if cell["stage"] is not None:
        cmd += ["--stage", str(cell["stage"])]
    if cell["reshard"] is not None:
        cmd += ["--reshard", str(cell["reshard"]).lower()]
    if profile_dir is not None:
        cmd += ["--profile-out", str(profile_dir)]
    return cmd


def _child_env(world_size: int, device: str = "cpu") -> dict[str, str]:
    env = dict(os.environ)
    cores = os.cpu_count() or 1
    # The same threads per process for every engine (and the floor): the cores shared by W ranks.
    env["OMP_NUM_THREADS"] = str(max(1, cores // world_size))
    if device == "cpu":
        env.setdefault("DS_ACCELERATOR", "cpu")
        env.setdefault("DS_BUILD_OPS", "0")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE.parent), env.get("PYTHONPATH", "")) if p)
    env.pop("WORLD_SIZE", None)
    env.pop("RANK", None)
    return env


def _failure_reason(stderr: str, returncode: int) -> str:
    """The last exception line of a failed run, or its exit status."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if ("Error" in ln or "Exception" in ln) and not ln.startswith(("File ", "[rank", "torch.distributed")):
            return ln[:300]
    return f"exit status {returncode}: " + (lines[-1][:200] if lines else "no output")


def run_cell(args: argparse.Namespace, cell: dict[str, Any], out_dir: Path) -> None:
    """Run one repeat of one cell; append its result or mark it failed."""
    safe = f"{cell['mode']}_{cell['label'].replace(' ', '_')}"
    profile_dir = out_dir / "profiles" / safe if cell["label"] in args.profile_labels else None
    with tempfile.TemporaryDirectory() as tmp:
        result_file = Path(tmp) / "result.json"
        cmd = _command(args, cell, result_file, profile_dir)
        load_before = os.getloadavg()[0]
        start = time.time()
        try:
            proc = subprocess.run(cmd, env=_child_env(args.world_size, args.device), capture_output=True, text=True,
                                  timeout=args.timeout)
            returncode, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
        except subprocess.TimeoutExpired as exc:
            returncode, stdout, stderr = -1, str(exc.stdout or ""), f"TimeoutError: over {args.timeout}s\n"
        log_path = out_dir / "logs" / f"{safe}_r{len(cell['logs'])}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log_path.write_text(" ".join(cmd) + "\n\n--- stdout\n" + stdout + "\n--- stderr\n" + stderr)
        cell["logs"].append(str(log_path))
        if returncode == 0 and result_file.exists():
            result = json.loads(result_file.read_text())
            result["load_before"] = load_before
            result["load_after"] = os.getloadavg()[0]
            result["wall_s"] = time.time() - start
            result["source"] = _source_version()
            cell["results"].append(result)
        else:
            cell["status"] = "failed"
            cell["reason"] = _failure_reason(stderr, returncode)


def _prepare_deepspeed(args: argparse.Namespace, console: Any) -> str | None:
    """Build DeepSpeed's CPU shared-memory comm op once, untimed; the reason if that fails.

    DeepSpeed JIT-compiles it (minutes on 2 cores) in its first `init_distributed`; doing it
    here keeps the compile out of the runs' time limits and out of their memory figures.
    """
    console.print("[dim]preparing DeepSpeed (JIT build of its CPU comm op on first use)...[/dim]")
    code = "from deepspeed.comm.torch import build_shm_op; build_shm_op()"
    try:
        proc = subprocess.run([sys.executable, "-c", code], env=_child_env(args.world_size, args.device),
                              capture_output=True, text=True, timeout=max(args.timeout, 900))
    except subprocess.TimeoutExpired:
        return "DeepSpeed's CPU comm op did not build within the time limit"
    if proc.returncode != 0:
        return "DeepSpeed does not start here: " + _failure_reason(proc.stderr, proc.returncode)
    return None


def orchestrate(args: argparse.Namespace) -> int:
    from rich.console import Console

    console = Console()
    name = args.name or datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    results_dir = Path(args.results_dir)
    out_dir = results_dir / name
    out_dir.mkdir(parents=True, exist_ok=True)
    args.profile_labels = {s.strip() for s in args.profile.split(",") if s.strip()}
    cells = plan_cells(args)
    ds_cells = [c for c in cells if c["engine"] == "deepspeed" and c["status"] == "pending" and args.device == "cpu"]
    if ds_cells:
        problem = _prepare_deepspeed(args, console)
        for c in ds_cells if problem else []:
            c["status"], c["reason"] = "not run", problem
    runnable = [c for c in cells if c["status"] == "pending"]
    (out_dir / "cells.json").write_text(json.dumps(cells, indent=1))
    loads = [os.getloadavg()[0]]
    started = time.time()
    for repeat in range(args.repeat):
        for i, cell in enumerate(runnable):
            if cell["status"] == "failed":
                continue
            console.print(f"[dim]repeat {repeat + 1}/{args.repeat}, run {i + 1}/{len(runnable)}:[/dim] "
                          f"{cell['mode']} {cell['label']} (load {os.getloadavg()[0]:.2f})")
            run_cell(args, cell, out_dir)
            if cell["status"] == "failed":
                console.print(f"  [red]failed[/red]: {cell['reason']}")
            loads.append(os.getloadavg()[0])
            # Saved after every run, so an interrupted sweep keeps what it measured.
            (out_dir / "cells.json").write_text(json.dumps(cells, indent=1))
    meta = _meta(args, name, loads, time.time() - started)
    (out_dir / "meta.json").write_text(json.dumps(meta, indent=1))
    return report(args, name)


def _meta(args: argparse.Namespace, name: str, loads: list[float], wall_s: float) -> dict[str, Any]:
    return {
        "name": name,
        "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "host": platform.node(), "cpu_count": os.cpu_count(), "python": platform.python_version(),
        "torch": _torch_version(), "deepspeed": _version("deepspeed"),
        "device": args.device, "gpu": _gpu_name(args.device),
        "world_size": args.world_size, "model": args.model, "steps": args.steps, "warmup": args.warmup,
        "global_batch": args.global_batch, "repeat": args.repeat,
        "omp_num_threads": max(1, (os.cpu_count() or 1) // args.world_size),
        "load_avg_1min_samples": loads, "wall_s": wall_s,
    }


def report(args: argparse.Namespace, name: str) -> int:
    """Summarise the saved runs of `name` (and of --merge): table, JSON, Markdown, chart."""
    from peers_report import markdown_table, print_table, summarise, write_chart, write_json
    from rich.console import Console

    results_dir = Path(args.results_dir)
    out_dir = results_dir / name
    cells = json.loads((out_dir / "cells.json").read_text())
    meta = json.loads((out_dir / "meta.json").read_text()) if (out_dir / "meta.json").exists() else {}
    for spec in [m for m in args.merge.split(",") if m]:
        other, _, modes = spec.partition(":")
        earlier = json.loads((results_dir / other / "cells.json").read_text())
        if modes:
            earlier = [c for c in earlier if c["mode"] in modes.split("+")]
        mine = {(c["mode"], c["label"]): c for c in cells}
        for match in earlier:
            cell = mine.get((match["mode"], match["label"]))
            if cell is None:
                cells.append(match)
            else:
                cell["results"] = match["results"] + cell["results"]
        meta.setdefault("merged", []).append(spec)
    rows = summarise(cells)
    title = (f"{meta.get('model', args.model)}, W={meta.get('world_size', args.world_size)}, "
             f"{meta.get('steps', args.steps)} steps, global batch {meta.get('global_batch', args.global_batch)}, "
             f"OMP threads {meta.get('omp_num_threads')}, torch {meta.get('torch')}"
             + (f", {meta['gpu']}" if meta.get("gpu") else ""))
    print_table(rows, title)
    write_json(results_dir / f"{name}.json", meta, rows, cells)
    (results_dir / f"{name}.md").write_text(f"{title}\n\n" + markdown_table(rows))
    write_chart(rows, results_dir / f"{name}.png", title)
    Console().print(f"results: {results_dir / name}.json, .md, .png; logs in {out_dir / 'logs'}")
    failed = [c for c in cells if c["status"] == "failed" and c["engine"] in ("zeroshard", "floor", "floor-par")]
    # A peer that fails is a finding for the table; zeroshard or the floor failing is a bug.
    return 1 if failed else 0


def _source_version() -> dict[str, Any]:
    """The checkout's commit and whether zeroshard/ had uncommitted changes when a run ended:
    the tree is shared, and the engine may change between the runs of one sweep."""
    def git(*cmd: str) -> str:
        try:
            return subprocess.run(["git", *cmd], cwd=HERE.parent, capture_output=True, text=True,
                                  timeout=30).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            return ""

    return {"commit": git("rev-parse", "--short", "HEAD"),
            "zeroshard_dirty": bool(git("status", "--porcelain", "--", "zeroshard"))}


def _version(package: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(package)
    except Exception:  # noqa: BLE001 - not installed
        return None


def _gpu_name(device: str) -> str | None:
    if device != "cuda":
        return None
    import torch

    return torch.cuda.get_device_name(0)


def _torch_version() -> str:
    import torch

    return torch.__version__


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.engine is not None:
        from peers_worker import main as worker_main

        return worker_main(args)
    if args.report_only:
        if not args.name:
            raise SystemExit("--report-only needs --name NAME (a folder under --results-dir).")
        return report(args, args.name)
    return orchestrate(args)


if __name__ == "__main__":
    raise SystemExit(main())
