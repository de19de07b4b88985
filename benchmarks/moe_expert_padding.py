"""The measurement behind `BMM_MAX_PADDING` (zeroshard/moe/autoep/expert_paths.py): time of the
expert paths alone, forward + backward, against the padding that bmm computes in vain.

    python benchmarks/moe_expert_padding.py --seconds 120 --out padding.json

Per load (local experts, mean rows per expert, skew of the routing), counts are drawn once;
then the paths take turns, one forward + backward each per round, until the load's share of
`--seconds` is spent; the table gives medians and bmm / loop. "loop_indexed" is the loop as it
was before (w[j] views, whose backward adds one full-size gradient per expert). A benchmark, not
a test: nothing asserts.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from zeroshard.moe.autoep.expert_paths import grouped_mm_available, padding_fraction, run_experts  # noqa: E402


def _loop_indexed(x, counts, w1, w2, w3, act):
    outs = []
    for j, chunk in enumerate(torch.split(x, counts)):
        outs.append(F.linear(act(F.linear(chunk, w1[j])) * F.linear(chunk, w3[j]), w2[j]))
    return torch.cat(outs)


def _counts(experts: int, mean_rows: int, skew: float, g: torch.Generator) -> list[int]:
    """Rows per expert: mean_rows * experts draws from probabilities exp(skew * i / experts)."""
    p = torch.exp(torch.linspace(0, skew, experts, dtype=torch.float64))
    drawn = torch.multinomial(p / p.sum(), mean_rows * experts, replacement=True, generator=g)
    return torch.bincount(drawn, minlength=experts).tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=120.0)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--ffn", type=int, default=176)
    parser.add_argument("--experts", default="64,8", help="local experts per load, comma-separated")
    parser.add_argument("--rows", default="16,96", help="mean rows per expert, comma-separated")
    parser.add_argument("--skews", default="0,1,2", help="routing skews, comma-separated")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    loads = [(int(e), int(r), float(s)) for e in args.experts.split(",") for r in args.rows.split(",")
             for s in args.skews.split(",")]
    share = args.seconds / len(loads)
    g = torch.Generator().manual_seed(0)
    act = nn.SiLU()
    results = []
    print(f"{'experts':>7} {'rows':>5} {'skew':>4} {'padding':>7} {'loop ms':>9} {'bmm ms':>8} {'gmm ms':>8} "
          f"{'indexed ms':>10} {'bmm/loop':>8}")
    for experts, rows, skew in loads:
        counts = _counts(experts, rows, skew, g)
        x = torch.randn(sum(counts), args.hidden, generator=g, requires_grad=True)
        w = [(torch.randn(experts, a, b, generator=g) * 0.05).requires_grad_()
             for a, b in ((args.ffn, args.hidden), (args.hidden, args.ffn), (args.ffn, args.hidden))]
        upstream = torch.randn(sum(counts), args.hidden, generator=g)
        paths = {"loop": "loop", "bmm": "bmm", "indexed": _loop_indexed}
        if grouped_mm_available(x, w[0]):
            paths["gmm"] = "grouped_mm"
        times: dict[str, list[float]] = {name: [] for name in paths}
        deadline = time.monotonic() + share
        first = True
        while not times["loop"] or time.monotonic() < deadline:
            for name, path in paths.items():
                t0 = time.perf_counter()
                fn = path if callable(path) else (lambda *a, p=path: run_experts(p, *a))
                fn(x, counts, *w, act).backward(upstream)
                if not first:
                    times[name].append(time.perf_counter() - t0)
            first = False
        med = {name: statistics.median(t) * 1e3 if t else float("nan") for name, t in times.items()}
        row = {"experts": experts, "mean_rows": rows, "skew": skew, "padding": round(padding_fraction(counts), 3),
               "repeats": len(times["loop"]), **{f"{k}_ms": round(v, 2) for k, v in med.items()},
               "bmm_over_loop": round(med["bmm"] / med["loop"], 3)}
        results.append(row)
        print(f"{experts:>7} {rows:>5} {skew:>4} {row['padding']:>7.2f} {med['loop']:>9.1f} {med['bmm']:>8.1f} "
              f"{med.get('gmm', float('nan')):>8.1f} {med['indexed']:>10.1f} {row['bmm_over_loop']:>8.2f}")
    if args.out:
        Path(args.out).write_text(json.dumps({"torch": torch.__version__, "threads": torch.get_num_threads(),
                                              "hidden": args.hidden, "ffn": args.ffn, "rows": results}, indent=1))


if __name__ == "__main__":
    main()
