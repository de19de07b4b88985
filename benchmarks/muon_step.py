"""Muon's optimizer step against AdamW's, with Newton-Schulz's FLOPs and how near the
machine's matmul rate it runs (issue 26 item 5).

    python benchmarks/muon_step.py                              # CPU: the demo model, a tiny MoE
    python benchmarks/muon_step.py --device cuda --json out.json

Two models, each trained by the engine (world 1, ZeRO-2, clipping 1.0; bf16 on a GPU):
- "demo": the demo GPT (zeroshard/models/gpt.py; `small` on the CPU, `medium` on a GPU);
  per-head through the parameter attributes (fused c_attn: 3 x n_head row blocks, the
  attention's c_proj: n_head column blocks), as a custom model sets them;
- "moe": a Moonlight-like DeepSeek-V3 (MLA without q_lora_rank, 16 routed experts top-2, a
  shared expert, first layer dense), built from a config; per-head through `per_head_muon`.

Per model three rows, AdamW, Muon (whole matrices) and Muon per-head, each the median over
--steps timed optimizer steps (`engine.step()`, synchronised) after --warmup; with --compile BACKEND
two more, the Muon rows with Newton-Schulz compiled (`compile_newton_schulz`, what
`engine.compile()` does; issue 40 item 4), with `x_eager`: their step_ms over the eager row's:
- step_ms: the optimizer step; x_adamw: step_ms / AdamW's;
- ns_ms: Newton-Schulz alone on this step's matrices, the owner's batches (same-shape blocks
  batched, as ShardedMuon does) timed on their own; ns_gflop: its FLOPs per step, 2 x the
  multiply-adds of the form `orthogonalize` picks per block (newton_schulz.py's cost model);
- ns_gflops: ns_gflop / ns_ms; of_bound: that over the measured matmul rate (a square matmul
  of --matmul-size in the Newton-Schulz compute dtype: the arithmetic bound on this machine).
Medians, since other processes share the machine. A benchmark, not a test: nothing asserts.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # zeroshard from the checkout

import zeroshard  # noqa: E402
from benchmarks.process_group import close_group  # noqa: E402
from benchmarks.process_group import init_group_of_one as init_group  # noqa: E402
from zeroshard.optim.muon import newton_schulz as ns  # noqa: E402

VOCAB = 256


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def demo_model(device: torch.device, per_head: bool) -> torch.nn.Module:
    from zeroshard.models import build_gpt

    torch.manual_seed(0)
    model = build_gpt("medium" if device.type == "cuda" else "small")
    if per_head:
        heads = model.config.n_head
        for block in model.blocks:
            block.attn.c_attn.weight.muon_num_heads = 3 * heads  # q, k, v heads stacked on the rows
            block.attn.c_proj.weight.muon_num_heads = heads
            block.attn.c_proj.weight.muon_head_axis = 1  # heads are the output projection's columns
    return model


def moe_model(device: torch.device, per_head: bool) -> torch.nn.Module:
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    del per_head  # the preset tags it from the config (`per_head_muon`)
    torch.manual_seed(0)
    wide = device.type == "cuda"
    return DeepseekV3ForCausalLM(DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=512 if wide else 128, intermediate_size=1024 if wide else 256,
        moe_intermediate_size=256 if wide else 64, num_hidden_layers=4 if wide else 3,
        num_attention_heads=8 if wide else 4, num_key_value_heads=8 if wide else 4, n_routed_experts=16,
        num_experts_per_tok=2, n_group=1, topk_group=1, n_shared_experts=1, first_k_dense_replace=1,
        q_lora_rank=None, kv_lora_rank=128 if wide else 32, qk_rope_head_dim=32 if wide else 8,
        qk_nope_head_dim=64 if wide else 16, v_head_dim=64 if wide else 16, max_position_embeddings=512,
    ))


MODELS = {"demo": demo_model, "moe": moe_model}


def engine_config(kind: str, device: torch.device, micro: int) -> dict[str, Any]:
    optimizer: dict[str, Any] = {"type": "AdamW", "params": {"lr": 3e-4, "weight_decay": 0.1}}
    if kind != "adamw":
        optimizer = {"type": "Muon", "params": {"lr": 0.02, "adam_lr": 3e-4, "weight_decay": 0.1}}
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
        "optimizer": optimizer, "zero_optimization": {"stage": 2}, "steps_per_print": 10**9,
    }
    if device.type == "cuda":
        config["bf16"] = {"enabled": True}
    return config


def ns_tasks(optimizer: Any) -> dict[tuple[int, int], int]:
    """(rows, cols) -> Newton-Schulz matrices of that shape per step (every block, rank 0 owns all)."""
    shapes: dict[tuple[int, int], int] = {}
    for layout in getattr(optimizer, "_layouts", {}).values():
        for task in layout.tasks:
            shapes[(task.rows, task.cols)] = shapes.get((task.rows, task.cols), 0) + task.blocks
    return shapes


def ns_flops(shapes: dict[tuple[int, int], int], method: str, steps: int = ns.DEFAULT_NS_STEPS) -> int:
    total = 0
    for (rows, cols), count in shapes.items():
        n, m = min(rows, cols), max(rows, cols)
        gram = method == "gram" and ns.gram_is_cheaper(n, m, steps)
        total += count * 2 * (ns.gram_cost(n, m, steps) if gram else ns.standard_cost(n, m, steps))
    return total


def time_ns(shapes: dict[tuple[int, int], int], device: torch.device, dtype: torch.dtype, method: str,
            repeats: int, orthogonalize=ns.orthogonalize) -> float:
    """Median ms of one step's Newton-Schulz calls (one batched call per block shape)."""
    batches = [torch.randn(count, r, c, device=device) for (r, c), count in shapes.items()]
    samples = []
    for i in range(repeats + 2):
        sync(device)
        start = time.perf_counter()
        for batch in batches:
            orthogonalize(batch, ns.DEFAULT_NS_STEPS, method, dtype)
        sync(device)
        if i >= 2:
            samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def matmul_gflops(device: torch.device, dtype: torch.dtype, size: int, repeats: int = 5) -> float:
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    samples = []
    for i in range(repeats + 2):
        sync(device)
        start = time.perf_counter()
        a @ b
        sync(device)
        if i >= 2:
            samples.append(time.perf_counter() - start)
    return 2 * size**3 / statistics.median(samples) / 1e9


def run_row(model_name: str, kind: str, device: torch.device, args: argparse.Namespace) -> dict[str, Any]:
    compiled = kind.endswith("-compiled")
    base = kind.removesuffix("-compiled")
    model = MODELS[model_name](device, per_head=base == "muon-per-head")
    config = engine_config(base, device, args.micro)
    if base == "muon-per-head" and model_name == "moe":
        config["optimizer"]["params"]["per_head_muon"] = True
        config["optimizer"]["params"]["per_head_muon_output"] = True
    engine, optimizer, _, _ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=config)
    if compiled:  # Newton-Schulz only: the timed step is the optimizer's
        optimizer.compile_newton_schulz(args.compile)
    gen = torch.Generator().manual_seed(0)
    step_ms = []
    for i in range(args.warmup + args.steps):
        x = torch.randint(0, VOCAB, (args.micro, args.seq), generator=gen).to(device)
        if model_name == "demo":
            loss = engine(x, x)[1]
        else:
            loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        sync(device)
        start = time.perf_counter()
        engine.step()
        sync(device)
        if i >= args.warmup:
            step_ms.append((time.perf_counter() - start) * 1e3)
    row: dict[str, Any] = {"model": model_name, "optimizer": kind, "step_ms": statistics.median(step_ms),
                           "params": sum(p.numel() for p in model.parameters())}
    if kind != "adamw":
        group = next(g for g in optimizer.param_groups if g["use_muon"])
        dtype = ns.resolve_ns_dtype(group["ns_dtype"], device, group["ns_method"])
        shapes = ns_tasks(optimizer)
        row.update({"ns_matrices": sum(shapes.values()), "ns_dtype": str(dtype).replace("torch.", ""),
                    "ns_gflop": ns_flops(shapes, group["ns_method"]) / 1e9,
                    "ns_ms": time_ns(shapes, device, dtype, group["ns_method"], args.steps, optimizer.orthogonalize)})
        row["ns_gflops"] = row["ns_gflop"] / (row["ns_ms"] / 1e3)
    del engine, optimizer, model
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--models", default="demo,moe")
    parser.add_argument("--steps", type=int, default=7, help="timed steps per row (the median is quoted)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--micro", type=int, default=None, help="micro-batch (default 4 on CPU, 8 on GPU)")
    parser.add_argument("--seq", type=int, default=None, help="sequence length (default 64 on CPU, 512 on GPU)")
    parser.add_argument("--matmul-size", type=int, default=None, help="default 1024 on CPU, 8192 on GPU")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--compile", default=None, metavar="BACKEND",
                        help="also time Muon with Newton-Schulz compiled by this torch.compile backend")
    args = parser.parse_args(argv)
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    on_gpu = device.type == "cuda"
    args.micro = args.micro or (8 if on_gpu else 4)
    args.seq = args.seq or (512 if on_gpu else 64)
    init_group(device)
    rows = []
    for name in args.models.split(","):
        compiled = ("muon-compiled", "muon-per-head-compiled") if args.compile else ()
        for kind in ("adamw", "muon", "muon-per-head", *compiled):
            rows.append(run_row(name, kind, device, args))
            print(f"measured {name} {kind}: step {rows[-1]['step_ms']:.2f} ms", file=sys.stderr, flush=True)
    bounds: dict[str, float] = {}
    for row in rows:
        if "ns_dtype" in row:
            dtype = getattr(torch, row["ns_dtype"])
            if row["ns_dtype"] not in bounds:
                bounds[row["ns_dtype"]] = matmul_gflops(device, dtype, args.matmul_size or (8192 if on_gpu else 1024))
            row["of_bound"] = row["ns_gflops"] / bounds[row["ns_dtype"]]
        adamw = next(r for r in rows if r["model"] == row["model"] and r["optimizer"] == "adamw")
        row["x_adamw"] = row["step_ms"] / adamw["step_ms"]
        if row["optimizer"].endswith("-compiled"):
            eager = next(r for r in rows if r["model"] == row["model"]
                         and r["optimizer"] == row["optimizer"].removesuffix("-compiled"))
            row["x_eager"] = row["step_ms"] / eager["step_ms"]
    header = (f"{'model':6} {'optimizer':14} {'step_ms':>9} {'x_adamw':>8} {'ns_mats':>8} {'ns_ms':>8} "
              f"{'ns_gflop':>9} {'ns_gflops':>10} {'of_bound':>9}")
    print(f"device {device} ({torch.cuda.get_device_name(0) if on_gpu else platform.processor() or 'cpu'}), "
          f"torch {torch.__version__}, micro {args.micro} x seq {args.seq}, medians of {args.steps} steps")
    print("matmul bound: " + ", ".join(f"{k} {v:.1f} GFLOP/s" for k, v in bounds.items()))
    print(header)
    for r in rows:
        ns_part = (f"{r['ns_matrices']:>8} {r['ns_ms']:>8.2f} {r['ns_gflop']:>9.3f} {r['ns_gflops']:>10.1f} "
                   f"{r['of_bound']:>9.1%}" if "ns_ms" in r else f"{'-':>8} {'-':>8} {'-':>9} {'-':>10} {'-':>9}")
        x_eager = f"  x_eager {r['x_eager']:.2f}" if "x_eager" in r else ""
        print(f"{r['model']:6} {r['optimizer']:14} {r['step_ms']:>9.2f} {r['x_adamw']:>8.2f} {ns_part}{x_eager}")
    if args.json:
        args.json.write_text(json.dumps({"device": str(device), "torch": torch.__version__, "micro": args.micro,
                                         "seq": args.seq, "matmul_gflops": bounds, "rows": rows}, indent=1))
    close_group()  # every row's engine is gone first (benchmarks/process_group.py)
    return 0


if __name__ == "__main__":
    sys.exit(main())
