"""One engine's rows of benchmarks/moe_experts.py: a Moonlight-like MoE block (DeepSeek-V3
routing, scaled down) swapped by the engine's AutoEP, timed forward + backward per expert path.

    python benchmarks/moe_experts_worker.py --engine deepspeed --seconds 20 --out rows.json

Runs under zeroshard's interpreter (engine "zeroshard", also imported by moe_experts.py) or a
DeepSpeed virtualenv's (engine "deepspeed": DeepSpeed's layers and zeroshard's, from the same
Hugging Face block, so the weights and the routing are the same). Rows take turns, one timed forward +
backward each per round, each while its last step time still fits before the deadline: a slow
phase of a shared machine falls on every row alike.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def add_shape_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--seconds", type=float, default=60.0, help="the whole run's time, setup included")
    parser.add_argument("--tokens", type=int, default=None, help="tokens per forward (cpu 1024, cuda 16384)")
    parser.add_argument("--hidden", type=int, default=None, help="hidden size (cpu 256, cuda 2048: Moonlight's)")
    parser.add_argument("--ffn", type=int, default=None, help="expert ffn size (cpu 176, cuda 1408: Moonlight's)")
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=6)
    parser.add_argument("--shared", type=int, default=2, help="shared experts")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default=None, help="cpu fp32, cuda bf16")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")


def fill_defaults(args: argparse.Namespace) -> argparse.Namespace:
    cuda = args.device == "cuda"
    args.tokens = args.tokens or (16384 if cuda else 1024)
    args.hidden = args.hidden or (2048 if cuda else 256)
    args.ffn = args.ffn or (1408 if cuda else 176)
    args.dtype = args.dtype or ("bf16" if cuda else "fp32")
    return args


class _Model(nn.Module):
    """Only what both AutoEPs look at: `config` and the block at `model.layers.0.mlp`."""

    def __init__(self, config, block: nn.Module) -> None:
        super().__init__()
        self.config = config
        self.model = nn.Module()
        self.model.layers = nn.ModuleList([nn.Module()])
        self.model.layers[0].mlp = block


def build_model(args: argparse.Namespace) -> nn.Module:
    """A DeepSeek-V3 MoE block (Moonlight's routing: sigmoid scores, one expert group,
    routed_scaling_factor 2.446, renormalised top-k) under a model-shaped holder; weights
    N(0, 0.02) from seed 0 (the block alone is not initialised by transformers)."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    config = DeepseekV3Config(
        vocab_size=64, hidden_size=args.hidden, intermediate_size=2 * args.hidden, moe_intermediate_size=args.ffn,
        num_hidden_layers=1, first_k_dense_replace=0, n_routed_experts=args.experts,
        num_experts_per_tok=args.top_k, n_shared_experts=args.shared, n_group=1, topk_group=1,
        routed_scaling_factor=2.446, norm_topk_prob=True, num_attention_heads=4, num_key_value_heads=4,
        q_lora_rank=None, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=32,
    )
    block = DeepseekV3MoE(config)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, p in sorted(block.named_parameters()):
            p.copy_(torch.randn(p.shape, generator=g) * 0.02)
        for _, b in block.named_buffers():
            b.zero_()
    return _Model(config, block)


def _zeroshard_rows(model: nn.Module, args: argparse.Namespace, x: torch.Tensor) -> tuple[nn.Module, dict, dict]:
    """The swapped layer, {row: setup function}, and facts about the routing."""
    from zeroshard.config.expert_parallel import ExpertParallelConfig
    from zeroshard.module_inject.auto_ep import replace_moe_layers
    from zeroshard.moe.autoep.expert_paths import grouped_mm_available, padding_fraction

    replace_moe_layers(model, ExpertParallelConfig(enabled=True), world_size=1)
    layer = model.model.layers[0].mlp.to(args.device, DTYPES[args.dtype])
    experts = layer.experts

    def fixed(path):
        def setup() -> None:
            experts.path = path
        return setup

    rows = {"auto": fixed(None), "loop": fixed("loop"), "bmm": fixed("bmm")}
    if grouped_mm_available(x, experts.w1):
        rows["grouped_mm"] = fixed("grouped_mm")
    with torch.no_grad():
        selected = layer.router(x.reshape(-1, x.shape[-1]))[2]
    counts = torch.bincount(selected.reshape(-1), minlength=layer.num_experts).tolist()
    facts = {"padding_fraction": round(padding_fraction(counts), 4), "max_rows_per_expert": max(counts),
             "mean_rows_per_expert": sum(counts) / len(counts)}
    return layer, rows, facts


def _deepspeed_rows(model: nn.Module, args: argparse.Namespace, x: torch.Tensor) -> tuple[nn.Module, dict, dict]:
    """DeepSpeed's AutoEP layer, built twice (its path is fixed at construction)."""
    import copy

    from deepspeed.module_inject.auto_ep import AutoEP
    from deepspeed.module_inject.auto_ep_config import parse_autoep_config

    layers = {}
    errors = {}
    for name, grouped in (("loop", False), ("grouped_mm", True)):
        try:
            candidate = copy.deepcopy(model)  # the block itself stays for zeroshard's swap
            autoep = AutoEP(candidate, parse_autoep_config({"enabled": True, "autoep_size": 1,
                                                             "use_grouped_mm": grouped}))
            autoep.replace_moe_layers(autoep.ep_parser(), 1, 0)
            layer = candidate.model.layers[0].mlp.to(args.device, DTYPES[args.dtype])
            _step(layer, x, torch.ones_like(x))  # fails here if the path cannot run
            layers[name] = layer
        except Exception as exc:  # noqa: BLE001 - the reason goes into the table
            errors[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    return layers, {}, {"errors": errors}


def _step(layer: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> None:
    out = layer(x)
    if isinstance(out, tuple):
        out = out[0]
    out.backward(grad)
    for p in layer.parameters():
        p.grad = None


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def run(args: argparse.Namespace, engine: str, deadline: float) -> dict[str, Any]:
    """zeroshard's rows (engine "zeroshard"), or DeepSpeed's and zeroshard's taking turns in
    this one process (engine "deepspeed", under DeepSpeed's interpreter), timed until
    `deadline` (time.monotonic())."""
    torch.set_grad_enabled(True)
    if args.threads:
        torch.set_num_threads(args.threads)
    model = build_model(args)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, args.tokens, args.hidden, generator=g).to(args.device, DTYPES[args.dtype])
    grad = torch.randn(1, args.tokens, args.hidden, generator=g).to(args.device, DTYPES[args.dtype])
    layers: dict[str, nn.Module] = {}
    setups: dict[str, Any] = {}
    facts: dict[str, Any] = {}
    if engine == "deepspeed":  # DeepSpeed's layers first: the zeroshard swap replaces the block
        ds_layers, _, facts = _deepspeed_rows(model, args, x)
        layers.update({f"deepspeed {name}": layer for name, layer in ds_layers.items()})
        facts["errors"] = {f"deepspeed {name}": e for name, e in facts.get("errors", {}).items()}
    layer, zs_setups, zs_facts = _zeroshard_rows(model, args, x)
    layers.update({f"zeroshard {name}": layer for name in zs_setups})
    setups.update({f"zeroshard {name}": setup for name, setup in zs_setups.items()})
    facts.update(zs_facts)
    times: dict[str, list[float]] = {name: [] for name in layers}
    taken: dict[str, set[str]] = {name: set() for name in layers}
    # Untimed first step of each layer (first-call allocations); it is also each row's first
    # estimate of its step time.
    estimate: dict[str, float] = {}
    for name, layer in layers.items():
        if name in setups:
            setups[name]()
        t0 = time.monotonic()
        _step(layer, x, grad)
        _sync(args.device)
        estimate[name] = time.monotonic() - t0
    # Rounds: the first times every row whatever the clock says (a row without a timing is no
    # row, and a loaded machine can spend the whole budget on imports and setup); after it a row
    # runs only while its step still fits before the deadline.
    while True:
        ran = False
        for name, layer in layers.items():
            if times[name] and time.monotonic() + estimate[name] > deadline:
                continue
            if name in setups:
                setups[name]()
            _sync(args.device)
            t0 = time.perf_counter()
            _step(layer, x, grad)
            _sync(args.device)
            estimate[name] = time.perf_counter() - t0
            times[name].append(estimate[name])
            ran = True
            path = getattr(getattr(layer, "experts", None), "last_path", None)
            if path is None and name.startswith("deepspeed"):
                path = "use_grouped_mm=" + str(getattr(layer.experts, "use_grouped_mm", "?"))
            if path:
                taken[name].add(path)
        if not ran:
            break
    rows = []
    for name in layers:
        median = statistics.median(times[name]) if times[name] else None
        row_engine, _, path = name.partition(" ")
        rows.append({
            "engine": row_engine, "path": path, "took": sorted(taken[name]), "repeats": len(times[name]),
            "median_ms": None if median is None else round(median * 1e3, 3),
            "tokens_per_s": None if median is None else round(args.tokens / median, 1),
        })
    for name, reason in facts.pop("errors", {}).items():
        row_engine, _, path = name.partition(" ")
        rows.append({"engine": row_engine, "path": path, "error": reason})
    return {"rows": rows, "facts": facts, "torch": torch.__version__}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_args(parser)
    parser.add_argument("--engine", choices=("zeroshard", "deepspeed"), required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--until", type=float, default=None,
                        help="time.time() to end by (the caller's clock, so this interpreter's start counts)")
    args = fill_defaults(parser.parse_args())
    deadline = time.monotonic() + args.seconds
    if args.until is not None:
        deadline = min(deadline, time.monotonic() + args.until - time.time())
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    result = run(args, args.engine, deadline)
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
