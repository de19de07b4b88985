"""`zeroshard simulate`: rank R of a W-rank job, trained for real on this one device, with
collectives that move no data (zeroshard/comm/simulated.py) and, with a fabric, take the time
an alpha-beta model gives them (zeroshard/comm/fabric.py). docs/simulate.md.

    zeroshard simulate ds_config.json --world-size 64 --rank 3 --model 8b --seq 4096 --fabric nvlink --json out.json

What is measured and what is modelled: the model, its memory and its compute are real (this
device runs rank R's forward, backward and step on its micro-batch); the bytes of each
collective are the engine's own (its recorder); the peers' data are stand-ins (this rank's
own, see the backend's note) and the wire time is the fabric model's. Every figure this
prints is marked "simulated".

A run: the model is built (under zero.Init at stage 3, so only this rank's shard is ever
allocated), `warmup` optimizer steps train while the peak memory is measured (the model
states by role are counted between the last warm-up step's boundary backward and its
optimizer step, when every role exists: the optimizer's state is made at its first step), then `steps`
timed steps without a fabric (the compute step) and, with a fabric, `steps` more with it,
alternating one of each so that a noisy machine slows both alike. Exposed communication is
the median fabric step minus the median compute step.
"""

from __future__ import annotations

import copy
import logging
import statistics
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from zeroshard.comm import simulated
from zeroshard.comm.fabric import Fabric
from zeroshard.tools.peak_memory import PeakMemory

__all__ = ["SimulateOptions", "simulate", "DEFAULT_SEQ"]

DEFAULT_SEQ = 4096  # the sequence when --seq is not given, cut to the model's longest


@dataclass
class SimulateOptions:
    """One simulated run (the command's flags).

    Attributes:
        config: a DeepSpeed-style config: a dict or a JSON/HJSON file path.
        world_size, rank: the job simulated and the rank this process is.
        model: a preset name (zeroshard.models.preset_names()) or module:factory; or
        hf_config: a Hugging Face config.json (or its folder).
        model_overrides: fields of the preset's config to change (e.g. checkpoint_activations).
        seq: tokens per sequence (None: the model's longest, at most DEFAULT_SEQ).
        micro_batch: sequences per micro-step (None: the config's train_micro_batch_size_per_gpu).
        steps: timed optimizer steps (per mode: compute-only, and with the fabric).
        warmup: untimed optimizer steps first, over which the peak memory is measured.
        fabric: the modelled fabric, or None; or a list of fabrics, each timed in turn (the
            report's `fabric` and `exposed_comm_s` are the first's, `fabrics` has them all).
        device: "cpu" or "cuda".
        engine: "zeroshard" or "fsdp2".
        zero_init: at stage 3, build under zeroshard.zero.Init (only this rank's shard is ever
            allocated); False builds the whole model first (tests compare with a real run so).
    """

    config: Any
    world_size: int
    rank: int = 0
    model: str | None = None
    hf_config: str | None = None
    model_overrides: dict | None = None
    seq: int | None = None
    micro_batch: int | None = None
    steps: int = 5
    warmup: int = 2
    fabric: Fabric | list[Fabric] | None = None
    device: str = "cpu"
    engine: str = "zeroshard"
    zero_init: bool = True


def _raw_config(options: SimulateOptions) -> dict:
    from zeroshard.config.file import read_config_file

    raw = copy.deepcopy(options.config) if isinstance(options.config, dict) else read_config_file(Path(options.config))
    if options.micro_batch is not None:
        # --micro-batch is the micro batch; the global batch follows from it (the triangle).
        raw["train_micro_batch_size_per_gpu"] = options.micro_batch
        raw.pop("train_batch_size", None)
    return raw


def _model_builder(options: SimulateOptions, sequence_group: Any) -> tuple[Callable[[], nn.Module], int, str]:
    """(a function building the model, its longest sequence, its name)."""
    from zeroshard.models import build_model, preset_info, preset_names
    from zeroshard.models.hf import build_hf_model, read_hf_config

    overrides = dict(options.model_overrides or {})
    if (options.model is None) == (options.hf_config is None):
        raise ValueError("give one of --model PRESET and --hf-config PATH.")
    if options.hf_config is not None:
        hf = read_hf_config(options.hf_config)
        if sequence_group is not None:
            raise ValueError(
                "sequence_parallel_size > 1 with --hf-config: simulate builds sequence parallelism into the "
                "Llama presets only. Set sequence_parallel_size to 1, or use --model 8b / 70b."
            )
        longest = int(hf.get("max_position_embeddings") or DEFAULT_SEQ)
        return (lambda: build_hf_model(hf, **overrides)), longest, f"hf:{hf['model_type']}"
    if ":" in options.model:
        import importlib
        import sys

        module_name, _, attr = options.model.partition(":")
        if "" not in sys.path:
            sys.path.insert(0, "")
        try:
            factory = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"--model {options.model}: cannot import {attr!r} from {module_name!r} ({exc}).") from None
        return factory, DEFAULT_SEQ, options.model
    if options.model not in preset_names():
        raise ValueError(f"--model {options.model}: unknown preset; use one of {', '.join(preset_names())}, "
                         "or module:factory.")
    info = preset_info(options.model)
    group = sequence_group

    def build() -> nn.Module:
        return build_model(options.model, sequence_group=group, **overrides) if group is not None else (
            build_model(options.model, **overrides))

    return build, info.max_seq_len, options.model


@contextmanager
def _simulated_log_prefix(world_size: int, rank: int):
    """Every line zeroshard logs during the run says it is simulated."""
    prefix = f"[simulated rank {rank} of {world_size}] "

    class _Prefix(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            if not str(record.msg).startswith("[simulated"):
                record.msg = prefix + str(record.msg)
            return True

    log = logging.getLogger("zeroshard")
    prefix_filter = _Prefix()
    log.addFilter(prefix_filter)
    try:
        yield
    finally:
        log.removeFilter(prefix_filter)


def simulate(options: SimulateOptions) -> dict[str, Any]:
    """Run one simulated rank; returns the report (the JSON the command writes)."""
    from zeroshard.resolve import resolve_config

    if options.engine not in ("zeroshard", "fsdp2"):
        raise ValueError(f"engine={options.engine!r}: 'zeroshard' or 'fsdp2'.")
    if not 0 <= options.rank < options.world_size:
        raise ValueError(
            f"--rank {options.rank}: must be in [0, {options.world_size}) for --world-size {options.world_size}. "
            "Pick a rank of the job."
        )
    if options.steps < 1 or options.warmup < 1:
        raise ValueError(f"--steps={options.steps}: at least 1 timed step (and 1 warm-up step).")
    if options.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available. Use --device cpu.")
    device = torch.device("cuda", torch.cuda.current_device()) if options.device == "cuda" else torch.device("cpu")
    raw = _raw_config(options)
    resolved = resolve_config(copy.deepcopy(raw), world_size=options.world_size)
    gas = resolved.gradient_accumulation_steps
    micro = resolved.train_micro_batch_size_per_gpu
    sp = resolved.sequence_parallel_size
    stage = resolved.zero_optimization.stage
    with simulated.world(options.world_size, options.rank, device=device.type) as sim, \
            _simulated_log_prefix(options.world_size, options.rank):
        sequence_group = None
        if sp > 1:
            from zeroshard.sequence import parallel_state_sp

            parallel_state_sp.initialize_sequence_parallel(sp)
            sequence_group = parallel_state_sp.sequence_parallel_layout().sequence
        build, longest, model_name = _model_builder(options, sequence_group)
        seq = options.seq if options.seq is not None else min(longest, DEFAULT_SEQ)
        if seq % sp:
            raise ValueError(f"--seq {seq}: must be divisible by sequence_parallel_size ({sp}), each rank holding "
                             "an equal slice.")
        gen = torch.Generator().manual_seed(1234 + options.rank)
        vocab, whole = _vocab_and_whole_size(options, build)

        def tokens() -> torch.Tensor:
            return torch.randint(0, vocab, (micro, seq // sp), generator=gen).to(device)

        runner, measured = train_and_measure(
            lambda: make_runner(options.engine, raw, build, device, resolved, options.zero_init),
            tokens, gas, options.warmup, device,
        )
        fabrics = [] if options.fabric is None else (
            list(options.fabric) if isinstance(options.fabric, (list, tuple)) else [options.fabric])
        compute: list[float] = []
        with_fabric: list[list[float]] = [[] for _ in fabrics]
        for _ in range(options.steps):
            sim.fabric = None
            compute.append(_timed_step(runner, tokens, gas, device))
            for fabric, times in zip(fabrics, with_fabric, strict=True):
                sim.fabric = fabric
                times.append(_timed_step(runner, tokens, gas, device))
        sim.fabric = None
        skipped = getattr(getattr(runner, "engine", None), "skipped_steps", 0)
        num_params = whole if whole is not None else sum(_full_numel(p) for p in runner.module.parameters())
    compute_s = statistics.median(compute)
    report: dict[str, Any] = {
        "simulated": True,
        "engine": options.engine,
        "world_size": options.world_size,
        "rank": options.rank,
        "model": model_name,
        "parameters": num_params,
        "stage": stage,
        "seq": seq,
        "micro_batch": micro,
        "gradient_accumulation_steps": gas,
        "sequence_parallel_size": sp,
        "device": device.type,
        **measured,
        "compute_step_s": compute_s,
        "skipped_steps": skipped,
    }
    per_step = measured["collectives"]
    rows = []
    for fabric, times in zip(fabrics, with_fabric, strict=True):
        step_s = statistics.median(times)
        rows.append({**fabric.describe(), "step_s": step_s, "exposed_comm_s": step_s - compute_s,
                     "modelled_comm_s": _modelled_seconds(per_step, fabric)})
    if rows:
        report["fabric"] = {k: v for k, v in rows[0].items() if k != "exposed_comm_s"}
        report["exposed_comm_s"] = rows[0]["exposed_comm_s"]
        if len(rows) > 1:
            report["fabrics"] = rows
    return report


def make_runner(
    engine: str, raw: dict, build: Callable[[], nn.Module], device: torch.device, resolved: Any, zero_init: bool = True
):
    """The engine's runner (zeroshard/tools/simulate_engines.py) for this config and model."""
    from zeroshard.tools.simulate_engines import FSDP2Runner, ZeroshardRunner

    if engine == "zeroshard":
        return ZeroshardRunner(raw, build, device, resolved.zero_optimization.stage, zero_init)
    return FSDP2Runner(raw, build, device, resolved)


def train_and_measure(
    runner_factory: Callable[[], Any], tokens: Callable[[], torch.Tensor], gas: int, warmup: int, device: torch.device
) -> tuple[Any, dict[str, Any]]:
    """Build the runner and train `warmup` steps while measuring the peak memory, count the
    model states by role (in the last warm-up step) and record one more step's collectives.
    The same on a simulated rank and on a real one (tests/dist/tools compares the two).

    Returns (the runner, {model_states_bytes, peak_device_allocated_bytes,
    peak_device_reserved_bytes, peak_host_bytes, collectives})."""
    with PeakMemory(device) as peak:
        runner = runner_factory()
        for step in range(warmup):
            _train_step(runner, tokens, gas, count_states=step == warmup - 1)
    with runner.recording() as collectives:
        _train_step(runner, tokens, gas)
    return runner, {
        "model_states_bytes": runner.model_state_bytes(),
        "peak_device_allocated_bytes": peak.device_allocated,
        "peak_device_reserved_bytes": peak.device_reserved,
        "peak_host_bytes": peak.host,
        "device_baseline_bytes": peak.baseline,
        "collectives": collectives(),
    }


def _vocab_and_whole_size(options: SimulateOptions, build: Callable[[], nn.Module]) -> tuple[int, int | None]:
    """(the token ids' range, the whole model's parameters when the engine's module will not
    show them all: a Hugging Face model, whose MoE blocks AutoEP may cut to this rank's experts).
    A preset's vocabulary is in its table; other models are built on the meta device to look
    (which imports torch's compiler stack for meta initialisers: seconds, so only when needed)."""
    from zeroshard.models import preset_info

    if options.model is not None and ":" not in options.model:
        return preset_info(options.model).vocab_size, None
    with torch.device("meta"):
        model = build()
    embeddings = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    if not embeddings:
        raise ValueError(
            f"--model {options.model}: the model has no nn.Embedding. simulate trains language models on "
            "token ids; give a model whose input is token ids (its first embedding sets their range)."
        )
    whole = sum(p.numel() for p in model.parameters()) if options.hf_config is not None else None
    return embeddings[0].num_embeddings, whole


def _full_numel(p: torch.Tensor) -> int:
    """A parameter's whole size: a stage-3 shard's `ds_numel`, an FSDP2 DTensor's global shape."""
    numel = getattr(p, "ds_numel", None)
    if numel is not None and p.numel() == 0:
        return int(numel)
    return int(torch.Size(p.shape).numel())


def _train_step(runner, tokens: Callable[[], torch.Tensor], gas: int, count_states: bool = False) -> None:
    for micro_step in range(gas):
        runner.micro_step(tokens(), boundary=micro_step == gas - 1, count_states=count_states)


def _timed_step(runner, tokens: Callable[[], torch.Tensor], gas: int, device: torch.device) -> float:
    batches = [tokens() for _ in range(gas)]  # made before the clock starts
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for micro_step, batch in enumerate(batches):
        runner.micro_step(batch, boundary=micro_step == gas - 1)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def _modelled_seconds(per_step: list[dict], fabric: Fabric) -> float:
    """The fabric's time for one step's collectives, one after another (nothing hidden)."""
    return sum(fabric.seconds(row.get("via", row["op"]), row["bytes"], row["group_size"]) * row["count"]
               for row in per_step)


# ---------------------------------------------------------------------------------------------
# The command
# ---------------------------------------------------------------------------------------------


def _human(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(nbytes) < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.2f} {unit}"
        nbytes /= 1024
    return f"{nbytes:.2f} GiB"


def report_lines(report: dict[str, Any]) -> list[str]:
    """The report as text, every line marked "simulated"."""
    states = report["model_states_bytes"]
    lines = [
        f"simulated: rank {report['rank']} of {report['world_size']}, engine {report['engine']}, model "
        f"{report['model']} ({report['parameters'] / 1e6:,.2f} M parameters), ZeRO stage {report['stage']}, "
        f"sequence {report['seq']}, micro-batch {report['micro_batch']} x {report['gradient_accumulation_steps']} "
        f"accumulation, on {report['device']}",
        "simulated model states per rank: "
        + ", ".join(f"{role} {_human(states[role])}" for role in (*states.keys(),) if role != "total")
        + f"; total {_human(states['total'])}",
        f"simulated peak memory: device allocated {_human(report['peak_device_allocated_bytes'])}, reserved "
        f"{_human(report['peak_device_reserved_bytes'])}; host {_human(report['peak_host_bytes'])}",
        f"simulated compute step (collectives take no time): {report['compute_step_s'] * 1e3:.1f} ms",
        "simulated collectives per step:",
    ]
    for row in report["collectives"]:
        via = f" (as {row['via']}, the backend's choice)" if "via" in row else ""
        lines.append(
            f"simulated   {row['op']:<15} x{row['count']:<4} over {row['group_size']} ranks, {row['dtype']}, "
            f"{_human(row['bytes'])} each{via}"
        )
    if "fabric" in report:
        fab = report["fabric"]
        exposed = report["exposed_comm_s"]
        share = exposed / fab["step_s"] if fab["step_s"] > 0 else 0.0
        lines.append(
            f"simulated with fabric {fab['name']} ({fab['bus_gbps']:g} GB/s, {fab['latency_us']:g} us per step): "
            f"step {fab['step_s'] * 1e3:.1f} ms, exposed communication {exposed * 1e3:.1f} ms ({share:.0%} of the "
            f"step; modelled wire time {fab['modelled_comm_s'] * 1e3:.1f} ms)"
        )
    return lines


def add_command(sub: Any, positive_int: Callable[[str], int]) -> None:
    """`zeroshard simulate` on the command's subparsers."""
    from zeroshard.models import preset_names

    cmd = sub.add_parser(
        "simulate",
        help="train rank R of a W-rank job on this one device, collectives simulated (see docs/simulate.md)",
        description="Run rank R of a W-rank job for real on one device over a process group whose collectives "
        "move no data; report its model states, peak memory, compute step, collectives and, with --fabric, the "
        "exposed communication. Everything it prints is simulated. Exits 2 on a bad config or argument.",
    )
    cmd.add_argument("config", metavar="CONFIG", help="DeepSpeed-style JSON config file")
    cmd.add_argument("--world-size", type=positive_int, required=True, metavar="W", help="ranks of the job simulated")
    cmd.add_argument("--rank", type=int, default=0, metavar="R", help="the rank this process is (default 0)")
    which = cmd.add_mutually_exclusive_group(required=True)
    which.add_argument("--model", metavar="PRESET|module:factory",
                       help=f"a model preset ({', '.join(preset_names())}) or module:factory")
    which.add_argument("--hf-config", metavar="PATH", help="a Hugging Face config.json (or its folder)")
    cmd.add_argument("--seq", type=positive_int, metavar="S", help=f"tokens per sequence (default: the model's "
                     f"longest, at most {DEFAULT_SEQ})")
    cmd.add_argument("--micro-batch", type=positive_int, metavar="M",
                     help="sequences per micro-step (default: the config's train_micro_batch_size_per_gpu)")
    cmd.add_argument("--steps", type=positive_int, default=5, metavar="N", help="timed steps (default 5)")
    cmd.add_argument("--fabric", metavar="nvlink|ib|NAME=GBps,latency_us",
                     help="model the communication on this fabric and report the exposed part")
    cmd.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu",
                     help="where rank R runs (default: cuda when available)")
    cmd.add_argument("--json", metavar="OUT", help="also write the report as JSON to OUT")
    cmd.set_defaults(handler=run_command)


def run_command(args: Any) -> int:
    import json
    import sys
    import warnings

    from zeroshard.comm.fabric import parse_fabric
    from zeroshard.config.error import ConfigError

    try:
        fabric = parse_fabric(args.fabric) if args.fabric else None
        options = SimulateOptions(
            args.config, args.world_size, args.rank, model=args.model, hf_config=args.hf_config, seq=args.seq,
            micro_batch=args.micro_batch, steps=args.steps, fabric=fabric, device=args.device,
        )
        with warnings.catch_warnings():
            show = warnings.showwarning

            def simulated_warning(message, category, filename, lineno, file=None, line=None):
                show(f"[simulated rank {args.rank} of {args.world_size}] {message}", category, filename, lineno,
                     file, line)

            warnings.showwarning = simulated_warning
            report = simulate(options)
    except (ConfigError, ValueError, ImportError, FileNotFoundError) as exc:
        print(f"zeroshard simulate: {exc}", file=sys.stderr)
        return 2
    except torch.OutOfMemoryError as exc:
        print(f"zeroshard simulate: simulated rank {args.rank} of {args.world_size} ran out of device memory: {exc}",
              file=sys.stderr)
        return 1
    for line in report_lines(report):
        print(line)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        print(f"simulated report written to {args.json}")
    return 0
