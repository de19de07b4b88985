"""Gram against standard Newton-Schulz: measured time and modelled work per aspect ratio.

    python benchmarks/newton_schulz.py                    # CPU fp32, and the GPU if there is one
    python benchmarks/newton_schulz.py --rows 1024 --ratios 1,2,4,8 --repeats 20 --json out.json

For each n x (ratio * n) matrix (and a batch of stacked experts) it times
`orthogonalize(..., method="gram")` and `method="standard"` in the compute dtype "auto" picks
(fp32 on CPU; fp16 Gram and bf16 standard on a GPU), with the Gram form forced even where
`gram_is_cheaper` would fall back, so the crossover shows. Columns: milliseconds per call
(the fastest of --repeats after --warmup; on a shared machine the others include
other processes' work), the measured speed-up standard / Gram, and the speed-up
the multiply-add model of newton_schulz.py predicts. A benchmark, not a test: nothing asserts.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # zeroshard from the checkout

from zeroshard.optim.muon import newton_schulz as ns  # noqa: E402


def _time_ms(fn, device: torch.device, warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        samples.append((time.perf_counter() - start) * 1e3)
    # The minimum: on a shared machine every other sample includes someone else's work.
    return min(samples)


def _forced(x: torch.Tensor, method: str, dtype: torch.dtype, steps: int) -> torch.Tensor:
    """One orthogonalization with the method forced (no cost-rule fallback), as in
    `orthogonalize`: transpose to n <= m, normalise, iterate."""
    if x.shape[-2] > x.shape[-1]:
        x = x.mT
    x = x.reshape(-1, x.shape[-2], x.shape[-1]).to(dtype)
    norms = torch.linalg.vector_norm(x.float(), dim=(-2, -1), keepdim=True)
    x = (x / (norms + ns.NORM_EPS).to(dtype)).contiguous()
    if method == "gram":
        return ns._gram(x, steps, ns.GRAM_RESTARTS)
    return ns._standard(x, steps)


def run(device: torch.device, rows: int, ratios: list[float], experts: int, steps: int,
        warmup: int, repeats: int) -> list[dict]:
    results = []
    shapes = [(1, rows, int(round(rows * r))) for r in ratios]
    if experts > 1:
        shapes.append((experts, rows // 2, 2 * rows))
    for batch, n, m in shapes:
        x = torch.randn(batch, n, m, device=device)
        row = {"device": device.type, "shape": [batch, n, m], "ratio": m / n}
        for method in ("gram", "standard"):
            dtype = ns.resolve_ns_dtype("auto", device, method)
            row[f"{method}_dtype"] = str(dtype).removeprefix("torch.")
            row[f"{method}_ms"] = _time_ms(lambda x=x, method=method, dtype=dtype: _forced(x, method, dtype, steps),
                                           device, warmup, repeats)
        row["measured_speedup"] = row["standard_ms"] / row["gram_ms"]
        row["model_speedup"] = ns.standard_cost(n, m, steps) / ns.gram_cost(n, m, steps)
        row["auto_uses_gram"] = ns.gram_is_cheaper(n, m, steps)
        results.append(row)
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=256, help="the short side n")
    parser.add_argument("--ratios", default="1,1.5,2,4,8", help="long side / short side, comma-separated")
    parser.add_argument("--experts", type=int, default=8, help="also a batch of this many experts (0: no)")
    parser.add_argument("--steps", type=int, default=ns.DEFAULT_NS_STEPS)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--device", action="append", help="cpu, cuda (default: cpu, and cuda when present)")
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args(argv)
    devices = args.device or (["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"])
    ratios = [float(r) for r in args.ratios.split(",")]
    rows = []
    header = f"{'device':6} {'shape':>18} {'ratio':>5} {'gram ms':>9} {'std ms':>9} {'speed-up':>8} {'model':>6} auto"
    print(header)
    for name in devices:
        device = torch.device(name)
        for row in run(device, args.rows, ratios, args.experts, args.steps, args.warmup, args.repeats):
            rows.append(row)
            shape = "x".join(map(str, row["shape"]))
            auto = "gram" if row["auto_uses_gram"] else "std"
            print(f"{row['device']:6} {shape:>18} {row['ratio']:5.2f} {row['gram_ms']:9.3f} "
                  f"{row['standard_ms']:9.3f} {row['measured_speedup']:8.2f} {row['model_speedup']:6.2f} {auto}")
    if args.json:
        meta = {"torch": torch.__version__, "platform": platform.platform(), "threads": torch.get_num_threads(),
                "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None}
        Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
