"""Checks c (Newton-Schulz in the device's default dtype against float64), d (offload equals no
offload) and e (an MoE layer and an AutoEP layer, forward and backward, device against CPU)."""

from __future__ import annotations

import copy
from typing import Any

import torch

from benchmarks.gpu_check.conformance import compare, train_case
from tests.dist.ns_reference import reference_newton_schulz
from tests.dist.reference import flat_cat
from tests.dist.scenarios.common import Case
from tests.dist.scenarios.offload import with_offload
from zeroshard.optim.muon.newton_schulz import orthogonalize, resolve_ns_dtype


def conditioned(rows: int, cols: int, condition: float, seed: int) -> torch.Tensor:
    """A float64 matrix with singular values spread log-uniformly over [1/condition, 1]."""
    gen = torch.Generator().manual_seed(seed)
    k = min(rows, cols)
    u, _ = torch.linalg.qr(torch.randn(rows, k, generator=gen, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(cols, k, generator=gen, dtype=torch.float64))
    s = torch.logspace(0, -torch.log10(torch.tensor(condition)).item(), k, dtype=torch.float64)
    return u @ torch.diag(s) @ v.T


# Relative Frobenius error of fp16 Gram Newton-Schulz against the float64 formula, condition
# number 1e2: each product rounds to 11 significant bits (~5e-4 relative) and the small singular
# directions (not yet converged after 5 steps) amplify it. Measured on the CPU, whose fp16 matmul
# accumulates in fp32 as a GPU's does: 4.6e-3 (16x64), 4.2e-3 (64x16), 6.6e-3 (32x96), 1.1e-2
# (128x512), 1.2e-2 (256x1024), 1.1e-2 (512x2048), 8.0e-3 (1024x4096). The bound allows 2x the
# worst; bf16 (what a wrong default would use) measures 3e-2 to 1e-1 on the same matrices.
NS_BOUND = 2.5e-2


def newton_schulz(device: torch.device, big: bool) -> dict[str, Any]:
    """Check c: `orthogonalize` with dtype "auto" on the device (the Gram form in fp16 on a GPU;
    the CPU's auto is fp32, so on the CPU fp16 is asked for by name, to run the same arithmetic)
    against `reference_newton_schulz` in float64, wide and tall, one matrix and a batch."""
    method_dtype = resolve_ns_dtype("auto", device, "gram")
    if device.type == "cuda":
        assert method_dtype == torch.float16, f"auto Newton-Schulz dtype on CUDA is {method_dtype}, not fp16"
    dtype = "auto" if device.type == "cuda" else "fp16"
    shapes = [(16, 64), (64, 16), (128, 512)] + ([(1024, 4096)] if big else [])
    numbers: dict[str, Any] = {"dtype": str(resolve_ns_dtype(dtype, device, "gram")).replace("torch.", "")}
    worst = 0.0
    for i, (rows, cols) in enumerate(shapes):
        g = conditioned(rows, cols, 1e2, seed=3 + i)
        out = orthogonalize(g.float().to(device), method="gram", dtype=dtype)
        exact = reference_newton_schulz(g)
        err = float((out.double().cpu() - exact).norm() / exact.norm())
        numbers[f"err_{rows}x{cols}"] = err
        worst = max(worst, err)
    batch = torch.stack([conditioned(32, 96, 1e2, seed=50 + e) for e in range(4)])
    out = orthogonalize(batch.float().to(device), method="gram", dtype=dtype).double().cpu()
    for e in range(4):
        exact = reference_newton_schulz(batch[e])
        worst = max(worst, float((out[e] - exact).norm() / exact.norm()))
    numbers["worst"] = worst
    if worst >= NS_BOUND:
        return "FAIL", numbers, f"Newton-Schulz relative error {worst:.3e} >= {NS_BOUND}"
    return numbers


# Offload steps AdamW on the CPU (zeroshard's CPU Adam) where the device steps its own: the same
# fp32 arithmetic in another implementation, so the two runs may differ by fp32 rounding only.
# The CPU matrix's fp32 parameter tolerance (1e-6 absolute after 3 steps, see reference._FP32)
# is that bound; a wrong offload (a lost accumulation, a stale copy) moves parameters by ~1e-3.
OFFLOAD_ATOL, OFFLOAD_RTOL = 1e-6, 1e-5


def offload(stage: int) -> dict[str, Any]:
    """Check d: stage 2 (optimizer offloaded) or 3 (optimizer and parameters), pinned host
    memory, fp32, 2 accumulation steps: equal to the same run without offload, and both equal
    to the reference."""
    case = Case(stage=stage, mode="fp32", micro=2, ga=2, steps=3)
    plain = train_case(case)
    off = train_case(with_offload(case))
    numbers = {"offload_vs_none_max": float((flat_cat(off["master"][-1]) - flat_cat(plain["master"][-1])).abs().max())}
    for step, (a, b) in enumerate(zip(off["master"], plain["master"], strict=True)):
        try:
            torch.testing.assert_close(flat_cat(a), flat_cat(b), atol=OFFLOAD_ATOL, rtol=OFFLOAD_RTOL)
        except AssertionError as error:
            return "FAIL", numbers, f"stage {stage}: offload vs none after step {step + 1}: {error}"
    checked = compare(case, off)
    if isinstance(checked, tuple):
        return "FAIL", {**numbers, **checked[1]}, "offload run vs reference: " + checked[2]
    return {**numbers, **{f"ref_{k}": v for k, v in checked.items()}}


# MoE on the device against the CPU: fp32 throughout, so only summation order differs (cuBLAS
# against the CPU's kernels, TF32 off as torch's default for matmuls). Both are held to 1e-5 of
# the largest value they are compared against: ~100 fp32 ulps, far below what a routing or
# scatter mistake does (a token sent to another expert changes its row by O(1)).
MOE_REL = 1e-5


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().cpu().double() - b.detach().cpu().double()).abs().max()) / max(
        float(b.detach().abs().max()), 1e-12)


def moe_layer(device: torch.device) -> dict[str, Any]:
    """Check e, zeroshard.moe.layer.MoE (ep_size 1, top-2, dropless): output, input gradient,
    gate and expert gradients of (out * w).sum() on the device against the CPU."""
    from tests.dist.scenarios.moe_layer import LayerCase, build_layer, rank_batch

    case = LayerCase(ep_size=1, k=2)
    numbers: dict[str, Any] = {}
    runs = []
    for where in (torch.device("cpu"), device):
        layer = build_layer(case, 1).to(where)
        x, w = rank_batch(case, 0)
        x = x.to(where).requires_grad_(True)
        out, _, _ = layer(x)
        (out * w.to(where)).sum().backward()
        runs.append({"out": out, "x_grad": x.grad,
                     **{f"grad.{n}": p.grad for n, p in layer.named_parameters() if p.grad is not None}})
    cpu, dev = runs
    assert cpu.keys() == dev.keys(), f"gradients differ in which exist: {sorted(cpu.keys() ^ dev.keys())}"
    for key in cpu:
        numbers[key.split(".")[0] if key.startswith("grad.") else key] = max(
            numbers.get(key.split(".")[0] if key.startswith("grad.") else key, 0.0), _rel_err(dev[key], cpu[key]))
    worst = max(numbers.values())
    if worst > MOE_REL:
        return "FAIL", numbers, f"MoE layer on {device} vs CPU: relative error {worst:.3e} > {MOE_REL}"
    return numbers


def autoep_layer(device: torch.device) -> dict[str, Any]:
    """Check e, AutoEP: a tiny Mixtral swapped by AutoEP (autoep_size 1); logits, router logits
    and every parameter's gradient of a loss on the device against the same on the CPU."""
    from tests.dist.scenarios.autoep import batch, build_hf
    from zeroshard.config.expert_parallel import ExpertParallelConfig
    from zeroshard.module_inject.auto_ep import autoep_layers, replace_moe_layers
    from zeroshard.moe.utils import attach_expert_groups

    base = build_hf("mixtral")
    replace_moe_layers(base, ExpertParallelConfig(enabled=True, autoep_size=1))
    attach_expert_groups(base)
    assert autoep_layers(base), "AutoEP swapped no layer"
    tokens = batch(0)
    runs = []
    for where in (torch.device("cpu"), device):
        model = copy.deepcopy(base).to(where)
        out = model(tokens.to(where), labels=tokens.to(where), output_router_logits=True)
        out.loss.backward()
        runs.append({"logits": out.logits, "router_logits": torch.cat(list(out.router_logits)), "loss": out.loss,
                     **{f"grad.{n}": p.grad for n, p in model.named_parameters() if p.grad is not None}})
    cpu, dev = runs
    assert cpu.keys() == dev.keys(), f"gradients differ in which exist: {sorted(cpu.keys() ^ dev.keys())}"
    numbers = {k: _rel_err(dev[k], cpu[k]) for k in ("logits", "router_logits", "loss")}
    numbers["grads"] = max(_rel_err(dev[k], cpu[k]) for k in cpu if k.startswith("grad."))
    worst = max(numbers.values())
    if worst > MOE_REL:
        return "FAIL", numbers, f"AutoEP on {device} vs CPU: relative error {worst:.3e} > {MOE_REL}"
    return numbers
