"""Tokens/s of one AutoEP MoE layer (zeroshard.moe.autoep.layer) per expert path: the per-expert
loop, one padded bmm, torch._grouped_mm where torch runs it, and "auto" (the path the layer
picks itself), forward + backward, medians over repeats.

    python benchmarks/moe_experts.py --device cpu --seconds 60 --out moe_experts.json
    python benchmarks/moe_experts.py --device cuda --seconds 120          # Moonlight's widths
    python benchmarks/moe_experts.py --deepspeed-python /tmp/dsvenv/bin/python   # + DeepSpeed's layer

The block is a DeepSeek-V3 MoE block (Moonlight's routing) built from a config: 64 experts,
top-6, 2 shared experts; hidden 256 / expert ffn 176 and 1024 tokens on CPU, Moonlight's 2048 /
1408 and 16384 tokens on CUDA (each a flag). With `--deepspeed-python`, the run moves to that
interpreter (zeroshard from this checkout on its PYTHONPATH) and DeepSpeed's own AutoEP layer
on the same block (its loop, use_grouped_mm false, and its grouped path) takes turns with
zeroshard's rows in one process; a path it cannot run is a row with the reason. The run ends
within `--seconds` from the start of main() (setup and one untimed step per row included; the
interpreter's start and torch's import before it are not), except that every row is timed at
least once, which on a loaded machine can take longer. A benchmark, not a test: nothing
asserts.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.moe_experts_worker import add_shape_args, fill_defaults, run  # noqa: E402

WORKER = Path(__file__).with_name("moe_experts_worker.py")
ROOT = Path(__file__).resolve().parents[1]


def _deepspeed(args: argparse.Namespace, seconds: float) -> dict:
    """Every row, from DeepSpeed's interpreter, or a row saying why there are none."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.json"
        cmd = [args.deepspeed_python, str(WORKER), "--engine", "deepspeed", "--out", str(out),
               "--seconds", f"{max(1.0, seconds - 2):.1f}", "--until", f"{time.time() + seconds - 5:.3f}",
               "--device", args.device, "--tokens", str(args.tokens),
               "--hidden", str(args.hidden), "--ffn", str(args.ffn), "--experts", str(args.experts),
               "--top-k", str(args.top_k), "--shared", str(args.shared), "--dtype", args.dtype]
        if args.threads:
            cmd += ["--threads", str(args.threads)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=max(1.0, seconds),
                                  env={**os.environ, "DS_BUILD_OPS": "0", "PYTHONPATH": str(ROOT)})
        except FileNotFoundError:
            return {"rows": [{"engine": "deepspeed", "path": "-", "error": f"no interpreter {args.deepspeed_python}"}]}
        except subprocess.TimeoutExpired:
            return {"rows": [{"engine": "deepspeed", "path": "-", "error": f"did not finish in {seconds:.0f} s"}]}
        if proc.returncode != 0 or not out.exists():
            last = [ln for ln in proc.stderr.splitlines() if ln.strip()][-1:] or [f"exit {proc.returncode}"]
            return {"rows": [{"engine": "deepspeed", "path": "-", "error": last[0][:300]}]}
        return json.loads(out.read_text())


def _table(result: dict) -> str:
    lines = [f"{'engine':<10} {'path':<11} {'took':<22} {'repeats':>7} {'median ms':>10} {'tokens/s':>10}"]
    for r in result["rows"]:
        if "error" in r:
            lines.append(f"{r['engine']:<10} {r['path']:<11} not run: {r['error']}")
            continue
        ms = "-" if r["median_ms"] is None else f"{r['median_ms']:.2f}"
        tps = "-" if r["tokens_per_s"] is None else f"{r['tokens_per_s']:.0f}"
        lines.append(f"{r['engine']:<10} {r['path']:<11} {','.join(r['took']) or '-':<22} {r['repeats']:>7} "
                     f"{ms:>10} {tps:>10}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_args(parser)
    parser.add_argument("--out", default=None, help="write the rows and settings as JSON")
    parser.add_argument("--deepspeed-python", default=None, help="a DeepSpeed 0.19 interpreter: adds its rows")
    args = fill_defaults(parser.parse_args())
    start = time.monotonic()
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        parser.exit(2, "--device cuda: no CUDA device is available to this torch build.\n")
    if args.deepspeed_python:
        result = _deepspeed(args, args.seconds - (time.monotonic() - start) - 1.0)
        result.setdefault("facts", {})
    else:
        result = run(args, "zeroshard", start + args.seconds - 1.0)
    result["settings"] = {k: v for k, v in vars(args).items() if k not in ("out", "deepspeed_python")}
    result["device_name"] = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    result["seconds_used"] = round(time.monotonic() - start, 1)
    print(f"AutoEP MoE layer, {args.device} {args.dtype}: {args.tokens} tokens, hidden {args.hidden}, ffn {args.ffn}, "
          f"{args.experts} experts top-{args.top_k}, {args.shared} shared; forward + backward")
    print(f"routing: {result['facts']}")
    print(_table(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
